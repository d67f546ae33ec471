"""``ray start`` with Ray's CLI already imported while the node waits for the head's address.

Importing Ray's CLI costs a second or two; a worker does it while the head is still
starting, so only the daemons' own start-up is left on the critical path once
``head.json`` appears. Usage (internal, from the node supervisor):
``python -m hpc_verl.bootstrap.raystart --head-file FILE --stop-file FILE --timeout-s T -- ARGS``
where ``@ADDRESS@`` in ARGS is replaced by the head's GCS address.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    opts, ray_args = argv[:sep], argv[sep + 1:]
    head_file = opts[opts.index("--head-file") + 1] if "--head-file" in opts else None
    stop_file = opts[opts.index("--stop-file") + 1] if "--stop-file" in opts else None
    timeout_s = float(opts[opts.index("--timeout-s") + 1]) if "--timeout-s" in opts else 300.0
    from ray.scripts import scripts  # the slow import, done before the address is known

    if head_file:
        deadline = time.monotonic() + timeout_s
        address = None
        while address is None:
            try:
                address = json.loads(open(head_file).read())["address"]
            except (OSError, ValueError, KeyError):
                if time.monotonic() > deadline or (stop_file and os.path.exists(stop_file)):
                    print(f"no head address in {head_file} within {timeout_s:g}s", file=sys.stderr)
                    return 3
                time.sleep(0.05)
        ray_args = [a.replace("@ADDRESS@", address) for a in ray_args]
    sys.argv = ["ray", "start", *ray_args]
    try:
        scripts.cli.main(args=["start", *ray_args], prog_name="ray", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # noqa: BLE001 - report as ray start would
        print(f"ray start failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
