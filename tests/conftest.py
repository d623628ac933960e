"""Tests run on the CPU with 8 virtual devices (for the sharding tests), XLA's backend
optimisation level 0 and older fusion emitters (they compile faster), and one cache of
compiled programs for the run (below)."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile for TPU topologies (libtpu) here and in subprocesses.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
# The suite's time goes to compiling: LLVM's optimisations off compile the tiny test
# programs about a third faster (they run slower, but they run for milliseconds).
if "xla_backend_optimization_level" not in flags:
  flags += " --xla_backend_optimization_level=0"
# At that level XLA's older CPU fusion emitters compile the test programs faster than the
# newer ones (a ReFusion and an AR engine's programs: 10.7-12.1 s against 14.6-16.8 s; the
# suite: 13.5 min against 23.5, docs/RESULTS.md). An XLA that no longer knows the flag
# would abort on it, so it is tried in a subprocess first (once per run: pytest-xdist's
# workers inherit the environment set here).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "xla_cpu_use_fusion_emitters" not in flags:
  try:
    _known = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
        env=dict(os.environ, XLA_FLAGS=f"{flags} {_LEGACY_EMITTERS}", JAX_PLATFORMS="cpu"),
        check=False, timeout=300).returncode == 0
  except subprocess.TimeoutExpired:
    _known = False
  if _known:
    flags += " " + _LEGACY_EMITTERS
os.environ["XLA_FLAGS"] = flags.strip()
# One on-disk cache of compiled programs for the whole run, so that the tests (and the
# servers, command lines and benchmarks they start as subprocesses, which inherit this
# environment, as do pytest-xdist's workers) compile each of the many identical tiny
# programs once. A run's cache is its own: made here and removed when the run ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="refusion_jax_tests_")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import jax  # noqa: E402  (after the environment above is set)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Frees each test module's compiled programs when it ends: the suite compiles
  hundreds of decode and training programs in one process."""
  yield
  jax.clear_caches()


def save_tiny_random_model(path: str, seed: int) -> str:
  """A 1-layer d=32 random Qwen3 (the bundled tokenizer's vocabulary) saved as a model
  folder: for tests of what wraps a model, not of what it has learned."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from refusion_jax import checkpoint, config  # pylint: disable=import-outside-toplevel
  from refusion_jax.model import Transformer  # pylint: disable=import-outside-toplevel
  model_config = config.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                             head_dim=16, mlp_dim=64, max_position_embeddings=256)
  checkpoint.save_model(path, model_config, Transformer(model_config, rngs=nnx.Rngs(seed)))
  return path


def pytest_configure(config):
  # qwix 0.1.8 (LoRA) reads flax Variables through attributes flax deprecated.
  config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:qwix.*")


def drive_live_batch(live, prompts, key2, max_passes: int, on_snapshot=None) -> dict:
  """Decodes `prompts` through a `decode.live.LiveBatch` as the server does: prompts join
  rows as rows free up (prompt i with key `key2` and id i), `max_passes` passes a run,
  a read after each (`on_snapshot(snapshot, jobs)`: the prompt index in each row, or
  None). Returns {prompt index: its tokens}."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import program as program_lib  # pylint: disable=import-outside-toplevel
  queue, jobs, got = list(range(len(prompts))), [None] * live.rows, {}
  while queue or any(j is not None for j in jobs):
    free_rows = [r for r, j in enumerate(jobs) if j is None]
    if queue and free_rows:
      take = [queue.pop(0) for _ in free_rows[:len(queue)]]
      into = free_rows[:len(take)]
      live.admit([prompts[i] for i in take], into, np.stack([key2] * len(take)), pids=take)
      for r, i in zip(into, take):
        jobs[r] = i
    live.run(max_passes=max_passes)
    snap = live.read()
    if on_snapshot is not None:
      on_snapshot(snap, jobs)
    done = [r for r, j in enumerate(jobs) if j is not None and snap.phase_b[r] == program_lib.DONE]
    for r in done:
      got[jobs[r]] = [int(t) for t in snap.tokens_bg[r, :int(snap.length_b[r])]]
      jobs[r] = None
    live.free(done)
  return got
