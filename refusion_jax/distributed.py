"""Joining the multi-process JAX runtime (training and the benchmarks alike)."""

from __future__ import annotations

import os

import jax


def initialize() -> None:
  """Joins the multi-process JAX runtime.

  On Cloud TPU pods (and SLURM / Open MPI / Kubernetes) everything is found
  automatically; elsewhere set JAX_COORDINATOR_ADDRESS (host:port of process
  0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process.
  """
  kwargs = {}
  for env, arg in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
    if os.environ.get(env):
      try:
        kwargs[arg] = int(os.environ[env])
      except ValueError:
        raise ValueError(f"{env}={os.environ[env]!r} is not an integer") from None
  jax.distributed.initialize(**kwargs)
