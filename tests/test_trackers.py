"""trainer.logger backends: each is read back with its own reader (TensorBoard's event
accumulator, MLflow's client, the records of wandb's offline run file), under verl's metric
names, and a resumed run continues the same tracker run. Nothing here touches the network:
wandb runs offline, MLflow on a store in the run dir, and this process refuses non-loopback
connections while the trainer runs.
"""
from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import pytest

pytest.importorskip("torch")
from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401

KEYS = ("actor/pg_loss", "critic/score/mean", "timing_s/step")


@pytest.fixture
def no_network(monkeypatch):
    real = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1")
                                          or host.startswith("/")):
            raise OSError(f"test: no network ({host})")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)


def _fit(tiny_model, digits_data, run: Path, steps: int) -> list[dict]:
    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.driver.inline_runner import InlineRunner
    from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer
    cfg = load_config(None, digit_overrides(tiny_model, digits_data, run, steps, (
        "trainer.logger=[console,file,tensorboard,wandb,mlflow]", "trainer.save_freq=2",
        "trainer.project_name=proj", "trainer.experiment_name=exp", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2")))
    tr = PPOTrainer(cfg, runner=InlineRunner(), progress=False)
    assert tr.fit() == 0
    return tr.history


def _wandb_records(path: Path) -> list[dict]:
    """History records of a wandb offline run file (a LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, header = 32768, 7
    pos, chunk, out = 7, b"", []
    while pos + header <= len(data):
        if block - pos % block < header:   # too little room left in the block for a header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        chunk += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):   # FULL or LAST
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunk)
            chunk = b""
            if rec.WhichOneof("record_type") == "history":
                out.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
            elif rec.WhichOneof("record_type") == "run":
                out.append({"_run_id": rec.run.run_id, "_project": rec.run.project, "_name": rec.run.display_name})
    return out


def test_every_backend_writes_the_steps_and_a_resume_appends(tiny_model, digits_data, tmp_path, no_network):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    run = tmp_path / "run"
    first = _fit(tiny_model, digits_data, run, 2)
    second = _fit(tiny_model, digits_data, run, 3)   # resume_mode=auto: from global_step_2
    assert [m["step"] for m in first] == [1, 2] and [m["step"] for m in second] == [3]
    expected = {m["step"]: m for m in first + second}

    # TensorBoard: one directory, steps 1..3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for key in KEYS:
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3], key
        assert [e.value for e in events] == pytest.approx([expected[s][key] for s in (1, 2, 3)], rel=1e-5)

    # MLflow: one run (the id kept in the run dir), steps 1..3
    import mlflow
    run_id = (run / "mlflow_run_id").read_text().strip()
    client = mlflow.tracking.MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    assert client.get_run(run_id).info.run_name == "exp"
    for key in KEYS:
        hist = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in hist) == [1, 2, 3], key
    # verl's total beside its per-phase keys: in MLflow's file store the total moves to .../total
    for key in ("timing_s/update_actor/total", "timing_s/update_actor/forward"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3], key
    assert "timing_s/update_actor" in expected[1] and "timing_s/update_actor/forward" in expected[1]
    assert len(client.search_runs([client.get_experiment_by_name("proj").experiment_id])) == 1

    # wandb offline: two sessions of the same run id, steps 1-2 then 3
    wid = (run / "wandb_run_id").read_text().strip()
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{wid}.wandb" for f in files)
    recs = [_wandb_records(f) for f in files]
    for r in recs:
        head = next(x for x in r if "_run_id" in x)
        assert head == {"_run_id": wid, "_project": "proj", "_name": "exp"}
    steps = [[h["_step"] for h in r if "_step" in h] for r in recs]
    assert steps == [[1, 2], [3]]
    assert [h["actor/pg_loss"] for h in recs[1] if "_step" in h] == pytest.approx([expected[3]["actor/pg_loss"]])


def test_unknown_or_missing_logger_is_one_line_before_training(cli, tiny_model, digits_data, tmp_path, monkeypatch):
    args = digit_overrides(tiny_model, digits_data, tmp_path / "run", 2)
    res = cli("train", *args, "trainer.logger=[console,tensorbord]")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "did you mean 'tensorboard'" in lines[0], res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # a backend whose package is absent (here: mlflow pointed at a module that does not exist)
    from hpc_verl.errors import ConfigError
    from hpc_verl.trainer.config import environment
    monkeypatch.setitem(environment.NEEDS, "mlflow", ("no_such_mlflow_module", "mlflow"))
    with pytest.raises(ConfigError, match=r"'mlflow' needs the 'no_such_mlflow_module' package.*hpc_verl\[mlflow\]"):
        environment.check_loggers(["console", "mlflow"])
    assert environment.check_loggers("console") == ["console"]
