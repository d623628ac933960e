"""The multi-host path: two local JAX processes (jax.distributed) train one model.

Each process owns 2 virtual CPU devices; the mesh spans all 4. The processes
read disjoint halves of every global batch, build the TFDS data once
(process 0, the other waits), save one checkpoint series and one final model.
At seq_len 64 the two halves of the eval file lose different numbers of
over-long rows (process 0 keeps 21 full eval batches, process 1 only 20), so
the full-file eval checks that every process runs the same eval steps.
A second two-process run resumes from the step-2 checkpoint and must repeat
steps 3 and 4 bit for bit.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
from flax import nnx

from refusion_jax import checkpoint
from refusion_jax.training import loop, outputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_two_processes(tmp_path, workdir, tag: str, extra_flags: list[str]):
  """Starts the trainer as JAX processes 0 and 1 of one job; returns (processes, logs)."""
  port = _free_port()
  command = [
      sys.executable, "-m", "refusion_jax.train",
      "--config=" + os.path.join(REPO, "configs", "tiny_refusion.py"),
      "--workdir=" + str(workdir), "--config.distributed=true",
      "--config.model.num_layers=1", "--config.data.seq_len=64",
      "--config.data.tfds_dir=" + str(tmp_path / "tfds"), "--config.global_batch_size=8",
      "--config.num_train_steps=4", "--config.optimizer.warmup_steps=0",
      "--config.checkpoint.every_steps=2",
      "--config.progress_bar=false", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
  ] + extra_flags
  procs, logs = [], []
  for process_id in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(process_id),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    log = open(tmp_path / f"{tag}_process{process_id}.log", "w")
    logs.append(log)
    procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT))
  return procs, logs


def _wait(procs, logs, timeout: float = 300) -> list[int]:
  try:
    return [p.wait(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for log in logs:
      log.close()


def _run_two_processes(tmp_path, workdir, tag: str, extra_flags: list[str]) -> None:
  """Runs the trainer as JAX processes 0 and 1 of one job; fails with a log tail."""
  codes = _wait(*_start_two_processes(tmp_path, workdir, tag, extra_flags))
  for i, code in enumerate(codes):
    assert code == 0, (tmp_path / f"{tag}_process{i}.log").read_text()[-3000:]


def _params(directory) -> dict:
  config, model = checkpoint.load_model(str(directory))
  assert config.num_layers == 1
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return {path: np.asarray(var.get_value()) for path, var in flat}


def test_two_processes_train_one_model(tmp_path):
  workdir = tmp_path / "run"
  _run_two_processes(tmp_path, workdir, "run",
                     ["--config.eval_every_steps=4", "--config.eval_batches=0"])

  # Process 0 alone writes the metrics log, one line per step, all finite,
  # plus one eval line at the last step.
  with open(workdir / outputs.METRICS_FILE) as f:
    rows = [json.loads(line) for line in f]
  train_rows = [r for r in rows if "loss" in r]
  eval_rows = [r for r in rows if "eval_loss" in r]
  assert len(train_rows) + len(eval_rows) == len(rows)
  assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) for r in train_rows)
  assert [r["step"] for r in eval_rows] == [4]
  assert np.isfinite(eval_rows[0]["eval_loss"])
  steps = sorted(int(n) for n in os.listdir(workdir / outputs.CHECKPOINT_DIR) if n.isdigit())
  assert steps == [2, 4]
  # The final model was renamed into place: no temporary folder is left.
  assert sorted(n for n in os.listdir(workdir) if n.startswith(".")) == []
  # The final model is complete and loads in a single process.
  params = _params(workdir / outputs.FINAL_MODEL_DIR)
  assert params and all(np.isfinite(x).all() for x in params.values())

  # Resume: the same job restarted from the step-2 checkpoint (parameters,
  # optimizer state and each process's data position) repeats steps 3 and 4.
  resumed = tmp_path / "resumed"
  shutil.copytree(workdir, resumed)
  shutil.rmtree(resumed / outputs.CHECKPOINT_DIR / "4")
  shutil.rmtree(resumed / outputs.FINAL_MODEL_DIR)
  _run_two_processes(tmp_path, resumed, "resume", ["--config.eval_every_steps=0"])
  for i in range(2):
    assert "resumed from" in (tmp_path / f"resume_process{i}.log").read_text()
  with open(resumed / outputs.METRICS_FILE) as f:
    again = [json.loads(line) for line in f]
  assert [r["step"] for r in again] == [1, 2, 3, 4]
  for first, second in zip(train_rows, again):
    # Throughput is wall-clock; everything else is a function of (seed, step, data).
    for record in (first, second):
      for key in ("tokens_per_sec", "samples_per_sec", "real_tokens_per_sec"):
        record.pop(key)
    assert first == second
  params_again = _params(resumed / outputs.FINAL_MODEL_DIR)
  assert params_again.keys() == params.keys()
  for path, value in params.items():
    np.testing.assert_array_equal(params_again[path], value, err_msg=str(path))


def test_a_preemption_notice_to_one_process_stops_both_at_one_checkpoint(tmp_path):
  # SIGTERM reaches process 1 only; JAX's preemption service passes the notice on and
  # both processes agree on one step, save it together and exit with EXIT_PREEMPTED.
  workdir = tmp_path / "run"
  flags = ["--config.num_train_steps=200", "--config.checkpoint.every_steps=1000",
           "--config.data.packing=first_fit"]
  procs, logs = _start_two_processes(tmp_path, workdir, "preempt", flags)
  metrics = workdir / outputs.METRICS_FILE
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and all(p.poll() is None for p in procs):
    if metrics.exists() and metrics.read_text().count("\n") >= 5:
      break
    time.sleep(0.02)
  assert all(p.poll() is None for p in procs), (tmp_path / "preempt_process0.log").read_text()
  os.kill(procs[1].pid, signal.SIGTERM)
  codes = _wait(procs, logs, timeout=120)
  assert codes == [loop.EXIT_PREEMPTED] * 2, (tmp_path / "preempt_process0.log").read_text()
  last = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
  assert 5 <= last < 200
  saved = sorted(int(n) for n in os.listdir(workdir / outputs.CHECKPOINT_DIR) if n.isdigit())
  assert saved == [last]
  # Each process saved its own data position in that checkpoint.
  data_files = os.listdir(workdir / outputs.CHECKPOINT_DIR / str(last) / "data")
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data_files)
  assert not (workdir / outputs.FINAL_MODEL_DIR).exists()
