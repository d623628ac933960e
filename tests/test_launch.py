"""The launch scripts: argument checks and --dry-run command lines (nothing is run)."""

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(script, *args):
  return subprocess.run(["bash", os.path.join(REPO, "launch", script), *args], cwd=REPO,
                        capture_output=True, text=True, timeout=60)


def test_tpu_pod_dry_run_trains_on_every_worker():
  done = _launch("tpu_pod.sh", "--tpu=pod", "--zone=us-east5-a", "--workdir=gs://b/run",
                 "--dry-run", "--", "--config.num_train_steps=10")
  assert done.returncode == 0, done.stderr
  lines = done.stdout.strip().splitlines()
  assert lines[0].startswith("git -C") and " archive " in lines[0]
  assert "tpu-vm scp" in lines[1] and "--worker=all" in lines[1]
  ssh = lines[2].replace("\\", "")
  assert "tpu-vm ssh pod" in ssh and "--worker=all" in ssh
  assert "--accelerator=tpu" in ssh
  assert "refusion_jax.train --config=configs/qwen3_8b_refusion.py" in ssh
  assert "--config.distributed=true --config.num_train_steps=10" in ssh


def test_gpu_and_reproduce_dry_runs():
  gpu = _launch("gpu.sh", "--workdir=/tmp/w", "--cuda=cuda13", "--dry-run", "--",
                "--config.global_batch_size=64")
  assert gpu.returncode == 0, gpu.stderr
  assert [line.strip() for line in gpu.stdout.splitlines()] == [
      "bash launch/setup_env.sh --accelerator=cuda13",
      ".venv/bin/python -m refusion_jax.train --config=configs/qwen3_0_6b_refusion.py "
      "--workdir=/tmp/w --config.global_batch_size=64"]
  repro = _launch("reproduce.sh", "--dry-run", "--workdir=/tmp/r", "--config.sweep=true")
  assert repro.returncode == 0, repro.stderr
  assert repro.stdout.splitlines()[-1].strip() == (
      ".venv/bin/python -m refusion_jax.reproduce --config=configs/repro_tiny.py "
      "--workdir=/tmp/r --config.sweep=true")
  long = _launch("reproduce.sh", "--dry-run", "--config=configs/repro_long.py")
  assert long.returncode == 0, long.stderr
  assert long.stdout.splitlines()[-1].strip() == (
      ".venv/bin/python -m refusion_jax.reproduce --config=configs/repro_long.py "
      "--workdir=runs/repro_long")


@pytest.mark.parametrize("script,args,message", [
    ("tpu_pod.sh", ["--zone=z", "--workdir=gs://b"], "--tpu=NAME is required"),
    ("tpu_pod.sh", ["--tpu=t", "--zone=z", "--workdir=w", "--config=configs/nope.py"],
     "config configs/nope.py does not exist"),
    ("tpu_pod.sh", ["--tpu=t", "--bogus"], "unknown argument --bogus"),
    ("gpu.sh", ["--dry-run"], "--workdir=DIR is required"),
    ("reproduce.sh", ["--dry-run", "--config=configs/nope.py"],
     "config configs/nope.py does not exist"),
    ("setup_env.sh", ["--accelerator=rocm"], "--accelerator must be cpu, tpu, cuda12 or cuda13"),
])
def test_bad_arguments_are_named(script, args, message):
  done = _launch(script, *args)
  assert done.returncode == 2
  assert message in done.stderr
