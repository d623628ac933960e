"""refusion_jax/runtime.py: no libtpu start-up errors where no TPU is (an entry point's and
a benchmark's), and the persistent compilation cache of sample, evaluate and reproduce,
each through a real command line on the shipped ReFusion model; and no module that
starts a backend when imported (start_up runs after the imports)."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from refusion_jax import loading, packaged, runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What libtpu prints when it starts on a machine without a TPU.
LIBTPU_NOISE = ("host bounds", "TPU_WORKER_HOSTNAMES", "Source Location Trace", "E0000")
ACCELERATOR = runtime._has_tpu() or runtime._has_gpu()  # pylint: disable=protected-access
LIBTPU = importlib.util.find_spec("libtpu") is not None


def _env(**changes):
  """The suite's environment without its JAX_PLATFORMS=cpu and its shared cache."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")}
  env.update(PYTHONPATH=REPO, **changes)
  return env


def _sample(*flags, **env):
  return subprocess.run(
      [sys.executable, "-m", "refusion_jax.sample", "--config=configs/sample.py",
       "--config.model_dir=refusion_tiny", "--config.prompt=copy 4230", *flags],
      cwd=REPO, capture_output=True, text=True, timeout=600, env=_env(**env))


@pytest.mark.skipif(ACCELERATOR or not LIBTPU,
                    reason="needs libtpu installed on a machine without accelerators")
def test_a_cpu_run_starts_without_libtpu_errors_and_a_second_run_loads_its_programs(tmp_path):
  # Without the check, JAX's first device query starts libtpu, which prints its errors.
  bare = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices())"],
                        capture_output=True, text=True, timeout=300, env=_env())
  assert bare.returncode == 0 and any(n in bare.stderr for n in LIBTPU_NOISE), bare.stderr
  cache = tmp_path / "cache"
  runs = [_sample(f"--config.compile_cache_dir={cache}", JAX_LOG_COMPILES="1")
          for _ in range(2)]
  for done in runs:
    assert done.returncode == 0, done.stderr[-3000:]
    # The shipped ReFusion model, the default method and settings, answers its example.
    assert json.loads(done.stdout)[0]["text"] == "4230"
    assert not [line for line in done.stderr.splitlines()
                if any(n in line for n in LIBTPU_NOISE)], done.stderr[-3000:]
  first, second = (d.stderr for d in runs)
  entries = sorted(os.listdir(cache))
  assert entries  # the first run kept its programs...
  compiled = second.count("Compiling ")
  # ...and the second found every one of them there, and kept nothing new.
  assert compiled > 0 and second.count("Persistent compilation cache hit") == compiled
  assert "Persistent compilation cache hit" not in first
  assert sorted(os.listdir(cache)) == entries
  # "" keeps no cache: every program compiles again.
  none = _sample("--config.compile_cache_dir=", JAX_LOG_COMPILES="1")
  assert none.returncode == 0 and "Persistent compilation cache hit" not in none.stderr


@pytest.mark.skipif(ACCELERATOR or not LIBTPU,
                    reason="needs libtpu installed on a machine without accelerators")
def test_a_benchmark_starts_as_the_entry_points_do(tmp_path):
  # forward_cost on the shipped model by its short name, run from a folder without one.
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "forward_cost.py"),
       "--model_dir=refusion_tiny", "--widths=1,4", "--passes=2", "--repeats=1"],
      cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env())
  assert done.returncode == 0, done.stderr[-3000:]
  assert "device: cpu" in done.stdout and "| 4 |" in done.stdout, done.stdout
  assert not any(n in done.stderr for n in LIBTPU_NOISE), done.stderr[-3000:]


def test_the_probe_leaves_a_set_platform_a_tpu_and_a_gpu_alone(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert runtime.quiet_tpu_probe() is False
  monkeypatch.delenv("JAX_PLATFORMS")
  for found in ("_has_tpu", "_has_gpu"):
    with monkeypatch.context() as m:
      m.setattr(runtime, found, lambda: True)
      assert runtime.quiet_tpu_probe() is False
  monkeypatch.setenv("JAX_FORCE_TPU_INIT", "1")
  assert runtime.quiet_tpu_probe() is False


def test_the_cache_folder_auto_empty_or_named(monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
  assert runtime.default_cache_dir() == str(tmp_path / "jax")
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert runtime.default_cache_dir() == str(tmp_path / "xdg" / "refusion_jax" / "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert runtime.default_cache_dir() == str(tmp_path / "home" / ".cache" / "refusion_jax" / "jax")
  for good in ("", "auto", str(tmp_path / "new" / "folder")):
    runtime.check_compile_cache(good)
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(ValueError, match="is a file, not a folder"):
    runtime.check_compile_cache(str(tmp_path / "a_file"))
  with pytest.raises(ValueError, match="cannot be made"):
    runtime.check_compile_cache(str(tmp_path / "a_file" / "cache"))
  with pytest.raises(ValueError, match=r"must be a folder path, \"auto\" or \"\""):
    runtime.check_compile_cache(3)


def test_the_shipped_refusion_model_matches_its_checksum():
  import hashlib  # pylint: disable=import-outside-toplevel
  folder = loading.resolve("refusion_tiny")
  assert folder == packaged.REFUSION_TINY_DIR
  assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*"))) == [
      "config.json", "metrics.jsonl", "model.safetensors", "model.safetensors.sha256"]
  with open(os.path.join(folder, "model.safetensors"), "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  with open(os.path.join(folder, "model.safetensors.sha256"), encoding="ascii") as f:
    assert f.read().split()[0] == digest
  with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  assert config["mask_token_id"] is not None  # a ReFusion model: it plans with masks


@pytest.mark.skipif(ACCELERATOR or not LIBTPU,
                    reason="needs libtpu installed on a machine without accelerators")
def test_processes_an_entry_point_starts_look_no_further_either():
  """The server's engine process and other children start JAX themselves."""
  code = ("from refusion_jax import runtime; import subprocess, sys; "
          "assert runtime.quiet_tpu_probe(); "
          "child = subprocess.run([sys.executable, '-c', 'import jax; print(jax.devices())'], "
          "capture_output=True, text=True); print(child.stdout); "
          "sys.stderr.write(child.stderr)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, env=_env())
  assert done.returncode == 0, done.stderr
  assert "CpuDevice" in done.stdout
  assert not any(n in done.stderr for n in LIBTPU_NOISE), done.stderr


def test_importing_any_module_starts_no_jax_backend():
  """Every module of the package imports without starting a JAX backend: an entry point
  runs `runtime.start_up` after its imports, and the platform it sets must still count."""
  code = """
import importlib, os
import jax
jax.config.update("jax_platforms", "no_such_platform")  # a backend started now fails
paths = [os.path.join(folder, f)[:-3] for folder, _, files in os.walk("refusion_jax")
         for f in files if f.endswith(".py")]
names = sorted(p.replace(os.sep, ".").removesuffix(".__init__") for p in paths)
for name in names:
  try:
    importlib.import_module(name)
  except RuntimeError as e:
    raise SystemExit(f"importing {name} starts a JAX backend: {e}") from None
print(len(names))
"""
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
  assert done.returncode == 0, done.stderr[-3000:]
  assert int(done.stdout.split()[-1]) > 50  # the whole package, not a part of it


_ENTRY = """
import sys
import jax
from ml_collections import config_flags
from refusion_jax import entry_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "a config file")

def main(argv):
  on = jax.config.jax_enable_compilation_cache
  print(on and jax.config.jax_compilation_cache_dir or "none")

entry_flags.run_program(main, "probe")
"""


@pytest.mark.parametrize("config, flag, want", [
    ("configs/tiny_refusion.py", "", "{env}"),  # train: "auto"
    ("configs/rl_tiny.py", "--config.compile_cache_dir={tmp}/rl", "{tmp}/rl"),
    ("configs/d2f_tiny.py", "--config.compile_cache_dir=", "none"),
    ("configs/sample.py", "", "{env}"),
])
def test_every_config_entry_point_keeps_its_programs_by_one_rule(tmp_path, config, flag, want):
  """Every entry point started by entry_flags.run_program uses its config's
  compile_cache_dir ("auto": $JAX_COMPILATION_CACHE_DIR, else the user's cache folder)."""
  env = _env(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env"))
  flags = [f"--config={config}"] + ([flag.format(tmp=tmp_path)] if flag else [])
  done = subprocess.run([sys.executable, "-c", _ENTRY, *flags], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == want.format(env=tmp_path / "env", tmp=tmp_path)
  bad = subprocess.run([sys.executable, "-c", _ENTRY, f"--config={config}",
                        f"--config.compile_cache_dir={__file__}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
      f"probe: error: --config.compile_cache_dir={__file__!r} is a file, not a folder")
