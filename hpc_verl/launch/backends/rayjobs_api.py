"""Talking to a running Ray cluster's Jobs API: connect, submit, state, logs, stop.

This is the second way people run verl (seed 003, sections 2 and 4): a Ray
cluster is up (started by hand, by an admin, or by ``hpc-verl cluster up``), and
the training driver is sent to it like ``ray job submit --runtime-env ...
--no-wait -- python3 -m verl.trainer.main_ppo ...``. We do the same through
``ray.job_submission.JobSubmissionClient`` (never a shell-out), so errors are
ours to explain: an unreachable address, a missing or wrong token, a Ray that is
too old, a failed driver each become one line with a fix. What to send, and the
registry, are the Ray Jobs backend's (``backends/rayjobs.py``).

Token authentication (Ray >= 2.52 turns it on for new clusters; the dashboard's
HTTP middleware checks ``Authorization: Bearer <token>``): we read the token from
a file and send the header ourselves, so the token never travels in the job's
runtime_env (which anyone who can list jobs can read) nor in process-wide
environment variables.

``ray`` is imported inside functions only: a login node without Ray can still
render and submit SLURM jobs.
"""
from __future__ import annotations

import asyncio
import os
import re
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TextIO

from hpc_verl.errors import SubmitError
from hpc_verl.launch.backends.base import JobState
from hpc_verl.util.versions import RAY_MIN_VERSION, version_tuple  # (verl's minimum: older Jobs APIs differ)

DEFAULT_CONNECT_TIMEOUT_S = 20.0
"""Bound on the first request (a black-holed address would otherwise hang: Ray sets none)."""
FAILED_LOG_LINES = 20
"""How many last log lines a 'job failed' error shows."""

# Ray JobStatus -> the job-state vocabulary every backend uses.
_STATE_OF_RAY_STATUS = {
    "PENDING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "SUCCEEDED": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "STOPPED": JobState.CANCELLED,
}

# Variables through which Ray's own client would silently replace the address we
# were given: `--ray-address` must mean what it says.
_ADDRESS_OVERRIDE_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


class RayJobsError(SubmitError):
    """Talking to a Ray cluster's Jobs API failed (base of the errors below)."""


class RayUnreachableError(RayJobsError):
    """Nothing (or no Ray dashboard) answers at the address."""


class RayAuthError(RayJobsError):
    """The cluster wants a token and we sent none, or a wrong one."""


class RayVersionError(RayJobsError):
    """Client or cluster Ray is older than verl supports."""


class RayJobFailedError(RayJobsError):
    """The driver exited non-zero; the message carries its last log lines."""


# --------------------------------------------------------------------------- address / token


def normalize_address(address: str) -> str:
    """``HOST:PORT`` or ``http(s)://HOST:PORT`` -> ``http(s)://HOST:PORT`` (no trailing /)."""
    addr = (address or "").strip().rstrip("/")
    if not addr:
        raise RayJobsError("--ray-address is empty; give the Ray dashboard address, "
                           "e.g. --ray-address http://HEAD:8265")
    if addr.startswith("ray://"):
        raise RayJobsError(f"--ray-address {address}: a Ray Client address (ray://) is not the "
                           "Jobs API; give the dashboard address instead, e.g. http://HEAD:8265")
    if "://" not in addr:
        addr = "http://" + addr
    scheme = addr.split("://", 1)[0]
    if scheme not in ("http", "https"):
        raise RayJobsError(f"--ray-address {address}: scheme '{scheme}' is not supported; "
                           "use http://HEAD:8265 (or https://)")
    if not re.match(r"^https?://[^/:\s]+(:\d+)?(/.*)?$", addr):
        raise RayJobsError(f"--ray-address {address}: not an address; use http://HEAD:8265")
    return addr


@dataclass(frozen=True)
class RayToken:
    """A token and where it came from (the source goes into error messages, never the value)."""

    value: str
    source: str


def resolve_token(token_file: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None) -> RayToken | None:
    """Find the Ray auth token: the given file, else Ray's own places.

    Order: ``token_file``; ``$RAY_AUTH_TOKEN``; ``$RAY_AUTH_TOKEN_PATH``;
    ``~/.ray/auth_token`` (the same places Ray's CLI looks, so a user who already
    uses ``ray job submit`` needs nothing new). ``None`` when there is none.
    """
    env = os.environ if env is None else env
    if token_file:
        return _read_token_file(Path(token_file).expanduser(), "--ray-token-file")
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return RayToken(env["RAY_AUTH_TOKEN"].strip(), "$RAY_AUTH_TOKEN")
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return _read_token_file(Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser(), "$RAY_AUTH_TOKEN_PATH")
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    default = home / ".ray" / "auth_token"
    if default.is_file():
        return _read_token_file(default, "~/.ray/auth_token")
    return None


def _read_token_file(path: Path, how: str) -> RayToken:
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        raise RayAuthError(f"Ray token file {path} (from {how}) does not exist; pass the token "
                           "file printed by `hpc-verl cluster up` (or `ray get-auth-token`)") from None
    except OSError as exc:
        raise RayAuthError(f"Ray token file {path} (from {how}) cannot be read ({exc.strerror}); "
                           "fix its permissions (chmod 600, owned by you)") from None
    if not value:
        raise RayAuthError(f"Ray token file {path} (from {how}) is empty; pass the token file "
                           "printed by `hpc-verl cluster up`")
    return RayToken(value, f"{path}")


# --------------------------------------------------------------------------- connection


def check_versions(client_version: str, cluster_version: str, address: str) -> None:
    """Both Rays must be >= RAY_MIN_VERSION; the message reports both versions."""
    minimum = version_tuple(RAY_MIN_VERSION)
    old = [who for who, v in (("client", client_version), ("cluster", cluster_version))
           if version_tuple(v) < minimum]
    if old:
        fix = ("upgrade the cluster's Ray (pip install -U 'ray[default]>=2.40' in its environment)"
               if "cluster" in old else "upgrade Ray here: pip install -U 'ray[default]>=2.40'")
        raise RayVersionError(
            f"Ray version mismatch: client {client_version}, cluster {cluster_version} at "
            f"{address}; hpc-verl needs Ray >= {RAY_MIN_VERSION} on both; {fix}")


@contextmanager
def _address_env_cleared() -> Iterator[None]:
    """Ray's client lets RAY_ADDRESS/RAY_API_SERVER_ADDRESS override our address: hide them."""
    saved = {k: os.environ.pop(k) for k in _ADDRESS_OVERRIDE_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _probe(address: str, headers: Mapping[str, str], token: RayToken | None,
           timeout_s: float) -> str:
    """GET /api/version with a bounded timeout; map every failure to one line. Returns the cluster version."""
    import requests

    url = f"{address}/api/version"
    try:
        resp = requests.get(url, headers=dict(headers), timeout=timeout_s)
    except requests.exceptions.Timeout:
        raise RayUnreachableError(
            f"Ray Jobs API at {address} did not answer within {timeout_s:g}s; check the address "
            "(head node name, dashboard port, default 8265) and that the cluster is up "
            "(`hpc-verl list` shows cluster jobs)") from None
    except requests.exceptions.RequestException as exc:
        reason = _short_reason(exc)
        raise RayUnreachableError(
            f"cannot reach the Ray Jobs API at {address} ({reason}); check the address (the "
            "dashboard port printed by `hpc-verl cluster up`, default 8265) and that the "
            "cluster is up") from None
    if resp.status_code == 401:
        raise RayAuthError(
            f"Ray cluster at {address} requires an auth token and none was sent; pass "
            "--ray-token-file FILE (printed by `hpc-verl cluster up`) or set RAY_AUTH_TOKEN_PATH")
    if resp.status_code == 403:
        src = token.source if token else "?"
        raise RayAuthError(
            f"Ray cluster at {address} rejected the auth token from {src} (403 invalid token); "
            "pass the token file of that cluster with --ray-token-file")
    if resp.status_code == 404:
        raise RayUnreachableError(
            f"{address} answers HTTP but is not a Ray Jobs API (404 on /api/version); give the "
            "Ray dashboard address (default port 8265), not the GCS or client port")
    try:
        resp.raise_for_status()
        return str(resp.json()["ray_version"])
    except Exception:  # noqa: BLE001 - any malformed answer means "not a Ray dashboard"
        raise RayUnreachableError(
            f"{address} did not answer like a Ray dashboard (HTTP {resp.status_code} on "
            "/api/version); give the Ray dashboard address, e.g. http://HEAD:8265") from None


def _short_reason(exc: BaseException) -> str:
    text = str(exc)
    if re.search(r"BadStatusLine|Remote end closed connection|RemoteDisconnected", text):
        return "it does not speak HTTP: is this the GCS or Ray Client port?"
    for pattern in (r"Connection refused", r"Name or service not known",
                    r"No route to host", r"Temporary failure in name resolution",
                    r"Connection reset by peer"):
        if re.search(pattern, text):
            return pattern.lower()
    return type(exc).__name__


@dataclass
class RayCluster:
    """A connected Jobs API client plus what we learned connecting (versions, token source)."""

    address: str
    client: Any  # ray.job_submission.JobSubmissionClient
    client_version: str
    cluster_version: str
    token_source: str | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # the token header, never printed

    def nodes(self, wait_s: float = 15.0) -> list[dict[str, Any]]:
        """The cluster's nodes (Ray's state API: ``state``, ``node_ip``, ``resources_total``); a head
        that has just started lists none for a few seconds, so wait up to ``wait_s`` for one."""
        import requests

        deadline = time.monotonic() + wait_s
        while True:
            try:
                resp = requests.get(f"{self.address}/api/v0/nodes", params={"detail": "1", "limit": "10000"},
                                    headers=self.headers, timeout=DEFAULT_CONNECT_TIMEOUT_S)
                resp.raise_for_status()
                found = list(resp.json()["data"]["result"]["result"])
            except Exception as exc:  # noqa: BLE001 - a busy dashboard drops a request: ask again, then one line
                if time.monotonic() > deadline:
                    raise RayJobsError(f"could not read the nodes of the Ray cluster at {self.address} "
                                       f"({_short_reason(exc)}); check that it is up") from None
                found = []
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def missing_modules(self, python: str, modules: list[str], timeout_s: float = 120.0) -> list[str]:
        """The ``modules`` the cluster's ``python`` cannot import (a short probe job, never the real one)."""
        import shlex

        # (the marker is joined at run time: a log that echoes the command holds no answer)
        code = ("import importlib.util as u; print('HPCV_' + 'MISSING:' + ' '.join(m for m in %r "
                "if u.find_spec(m) is None))" % (list(modules),))
        sid = self.submit(shlex.join([python, "-c", code]), {},
                          submission_id=f"hpcverl-probe-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        state = self.wait(sid, timeout_s)
        text = self.logs(sid)
        found = re.search(r"^HPCV_MISSING:(.*)$", text, re.M)
        if found is None:
            raise RayJobsError(f"could not check the Python of the Ray cluster at {self.address}: a probe with "
                               f"'{python}' ended {state} without an answer; check that '{python}' runs on the "
                               "cluster (the profile's ray.python)")
        return found.group(1).split()

    # ------------------------------------------------------------------ jobs
    def submit(self, entrypoint: str, runtime_env: Mapping[str, Any] | None = None, *,
               submission_id: str | None = None, metadata: Mapping[str, str] | None = None,
               entrypoint_num_cpus: float | None = None,
               entrypoint_num_gpus: float | None = None) -> str:
        """Submit a driver; returns the submission id (Ray's ``--no-wait``)."""
        kwargs: dict[str, Any] = {}
        if entrypoint_num_cpus is not None:
            kwargs["entrypoint_num_cpus"] = entrypoint_num_cpus
        if entrypoint_num_gpus is not None:
            kwargs["entrypoint_num_gpus"] = entrypoint_num_gpus
        with self._errors("submit a job to"):
            return self.client.submit_job(
                entrypoint=entrypoint, runtime_env=dict(runtime_env or {}) or None,
                submission_id=submission_id, metadata=dict(metadata or {}) or None, **kwargs)

    def info(self, submission_id: str) -> Any:
        with self._errors("query", submission_id):
            return self.client.get_job_info(submission_id)

    def state(self, submission_id: str) -> JobState:
        """PENDING / RUNNING / COMPLETED / FAILED / CANCELLED."""
        return state_of(self.info(submission_id).status)

    def logs(self, submission_id: str) -> str:
        with self._errors("read logs of", submission_id):
            return self.client.get_job_logs(submission_id)

    def follow(self, submission_id: str, write: Callable[[str], Any]) -> JobState:
        """Stream the driver's output until the job ends; returns the final state."""
        async def _tail() -> None:
            async for chunk in self.client.tail_job_logs(submission_id):
                write(chunk)

        with self._errors("follow logs of", submission_id), warnings.catch_warnings():
            # Ray's websocket call trips an aiohttp deprecation warning (ssl=None): not ours to show.
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.run(_tail())
        # The websocket closes when the job is terminal, but the status may lag a moment.
        deadline = time.monotonic() + 10
        while True:
            state = self.state(submission_id)
            if state.terminal or time.monotonic() > deadline:
                return state
            time.sleep(0.2)

    def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop the driver (SIGTERM, then SIGKILL after Ray's grace period)."""
        with self._errors("stop", submission_id):
            return bool(self.client.stop_job(submission_id))

    def wait(self, submission_id: str, timeout_s: float | None = None,
             poll_s: float = 0.5) -> JobState:
        """Block until the job is terminal; returns its state (no exception on failure)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.state(submission_id)
            if state.terminal:
                return state
            if deadline is not None and time.monotonic() > deadline:
                return state
            time.sleep(poll_s)

    def failure(self, submission_id: str, lines: int = FAILED_LOG_LINES) -> RayJobFailedError:
        """A one-line error for a failed job followed by its last log lines."""
        info = self.info(submission_id)
        tail = last_lines(self.logs(submission_id), lines)
        why = short_message(info.message) or "driver failed"
        code = getattr(info, "driver_exit_code", None)
        head = (f"Ray job {submission_id} failed"
                + (f" (exit code {code})" if code is not None else "")
                + f": {why}; see `hpc-verl logs {submission_id}` for the full log")
        return RayJobFailedError(head + ("\n--- last log lines ---\n" + tail if tail else ""))

    @contextmanager
    def _errors(self, verb: str, submission_id: str | None = None) -> Iterator[None]:
        """Ray raises RuntimeError/ConnectionError/AuthenticationError: make them one line."""
        try:
            yield
        except RayJobsError:
            raise
        except Exception as exc:  # noqa: BLE001 - Ray's client uses plain RuntimeError
            raise _translate(exc, verb, self.address, submission_id) from None


def _translate(exc: BaseException, verb: str, address: str, submission_id: str | None) -> RayJobsError:
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    name = type(exc).__name__
    what = f"job {submission_id} on {address}" if submission_id else address
    if name == "AuthenticationError":
        return RayAuthError(f"Ray cluster at {address} refused our token while trying to {verb} "
                            f"{what}: {first}; pass the cluster's token file with --ray-token-file")
    if "does not exist" in text or "404" in text and submission_id:
        return RayJobsError(f"Ray job {submission_id} is not known to the cluster at {address} "
                            "(it may have been restarted); check `hpc-verl list`")
    if isinstance(exc, ConnectionError) or "Connection" in name or "connect" in text.lower():
        return RayUnreachableError(f"lost the Ray Jobs API at {address} while trying to {verb} "
                                   f"{what} ({_short_reason(exc)}); check that the cluster is still up")
    return RayJobsError(f"could not {verb} {what}: {first}")


def connect(address: str, token_file: str | os.PathLike[str] | None = None, *,
            timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
            env: Mapping[str, str] | None = None) -> RayCluster:
    """Connect to a cluster's Jobs API, checking reachability, token and versions first.

    The check is a bounded ``GET /api/version`` (Ray's own client has no timeout
    and would hang on a black-holed address), so every failure is one line.
    """
    try:
        import ray
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise RayJobsError("Ray is not installed here; install it with "
                           "pip install 'hpc_verl[ray]' (Ray >= 2.40 with the dashboard extras)") from None
    _quiet_ray_client_logs()
    addr = normalize_address(address)
    token = resolve_token(token_file, env=env)
    headers = {"Authorization": f"Bearer {token.value}"} if token else {}
    cluster_version = _probe(addr, headers, token, timeout_s)
    check_versions(ray.__version__, cluster_version, addr)
    with _address_env_cleared():
        try:
            client = JobSubmissionClient(addr, headers=headers or None)
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, "connect to", addr, None) from None
    return RayCluster(address=addr, client=client, client_version=ray.__version__,
                      cluster_version=cluster_version, token_source=token.source if token else None,
                      headers=headers)


def _quiet_ray_client_logs() -> None:
    """Ray's SDK logs INFO lines (websocket closed, uploading package) to stderr: keep our output ours."""
    import logging

    for name in ("ray.dashboard.modules.job.sdk", "ray.dashboard.modules.dashboard_sdk",
                 "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)


def state_of(ray_status: Any) -> JobState:
    """Ray's JobStatus (enum or string) -> our state (UNKNOWN for a status this Ray added)."""
    raw = str(getattr(ray_status, "value", ray_status)).upper()
    return _STATE_OF_RAY_STATUS.get(raw, JobState.UNKNOWN)


def short_message(message: str | None) -> str:
    """Ray's job message without the log copy it appends ("..., last available logs ...")."""
    first = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    return re.split(r",\s*last available logs", first)[0].rstrip(" :")


def last_lines(text: str, n: int = FAILED_LOG_LINES) -> str:
    lines = [ln for ln in (text or "").rstrip("\n").splitlines()]
    return "\n".join(lines[-n:])


# --------------------------------------------------------------------------- handle


class RayJobHandle:
    """What ``hpc_verl.submit(..., ray_address=...)`` returns: state, logs, wait, stop.

    Reconnects lazily (a handle can be rebuilt from a registry record in another
    process); the token is re-read from its file, never stored.
    """

    def __init__(self, address: str, submission_id: str, token_file: str | None = None,
                 cluster: RayCluster | None = None) -> None:
        self.address = address
        self.submission_id = submission_id
        self.job_id = submission_id
        self.token_file = token_file
        self._cluster = cluster

    @property
    def cluster(self) -> RayCluster:
        if self._cluster is None:
            self._cluster = connect(self.address, self.token_file)
        return self._cluster

    @property
    def state(self) -> JobState:
        return self.cluster.state(self.submission_id)

    def done(self) -> bool:
        return self.state.terminal

    def logs(self) -> str:
        return self.cluster.logs(self.submission_id)

    def follow(self, out: TextIO | None = None) -> JobState:
        stream = out or sys.stdout
        return self.cluster.follow(self.submission_id, lambda s: (stream.write(s), stream.flush()))

    def wait(self, timeout_s: float | None = None, check: bool = True) -> JobState:
        """Wait for the end; with ``check`` a failed job raises RayJobFailedError (last lines)."""
        state = self.cluster.wait(self.submission_id, timeout_s)
        if check and state is JobState.FAILED:
            raise self.cluster.failure(self.submission_id)
        return state

    def stop(self) -> bool:
        return self.cluster.stop(self.submission_id)

    cancel = stop

    def __repr__(self) -> str:
        return f"RayJobHandle({self.submission_id!r} on {self.address})"
