"""A private Ray's late log subscriber (ray_runner._quiet_late_log_subscriber): its RpcError after our
own shutdown is dropped, so a run that fails while Ray comes up ends in its one error line; any
other thread's error is still reported. (The real race needs a loaded machine: seen once in CI.)"""
from __future__ import annotations

import threading

from hpc_verl.trainer.driver import ray_runner


class RpcError(Exception):
    """Named like ray.exceptions.RpcError, the error the late subscribe raises."""


def _run(name: str, exc: BaseException) -> None:
    def boom() -> None:
        raise exc
    t = threading.Thread(target=boom, name=name)
    t.start()
    t.join()


def test_only_the_log_threads_rpc_error_is_dropped():
    saved = threading.excepthook
    seen: list[str] = []
    threading.excepthook = lambda args: seen.append(f"{args.thread.name}: {type(args.exc_value).__name__}")
    try:
        ray_runner._quiet_late_log_subscriber()
        ray_runner._quiet_late_log_subscriber()   # installed once
        _run("ray_print_logs", RpcError("failed to connect to all addresses"))
        assert seen == []
        _run("ray_print_logs", ValueError("something else"))
        _run("worker", RpcError("not the log thread"))
        assert seen == ["ray_print_logs: ValueError", "worker: RpcError"]
    finally:
        threading.excepthook = saved
