"""Tests run on the CPU with 8 virtual devices (for the sharding tests)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


import jax  # noqa: E402  (after the environment above is set)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Frees each test module's compiled programs when it ends: the suite compiles
  hundreds of decode and training programs in one process."""
  yield
  jax.clear_caches()
