"""HBM traffic counted from compiled TPU programs, against hand counts.

Each program is compiled for a real TPU slice without a TPU (libtpu from the
test setup) and its traffic is known by construction: a sharded matmul reads
its weight shard once, an in-place cache update moves its update and not the
cache, a gather reads its rows and not the table, a scan over stacked layers
reads every layer once. XLA's own "bytes accessed" misses the last three.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from refusion_jax import hlo_traffic

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
topologies = pytest.importorskip("jax.experimental.topologies")


@pytest.fixture(scope="module")
def mesh():
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
  return jax.sharding.Mesh(np.asarray(devices).reshape(1, 4), ("data", "tensor"))


def _compiled(fn, mesh, *specs, donate=()):
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
          for shape, dtype, spec in specs]
  return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def _close(got, want, rel=0.05):
  assert abs(got - want) <= rel * want, (got, want)


def test_sharded_matmul_reads_its_weight_shard_once(mesh):
  b, d, f = 64, 2048, 8192
  compiled = _compiled(lambda x, w: x @ w, mesh, ((b, d), jnp.bfloat16, P()),
                       ((d, f), jnp.bfloat16, P(None, "tensor")))
  want = (b * d + d * f // 4 + b * f // 4) * 2  # x, the weight shard, the output shard
  _close(hlo_traffic.hbm_bytes(compiled.as_text()).total, want)


@pytest.mark.parametrize("kind", ["dynamic_update_slice", "scatter"])
def test_in_place_cache_update_moves_the_update_not_the_cache(mesh, kind):
  # The decoders' cache write: a few entries per row into a donated [B, K, S, H] buffer.
  b, k, s, h, t = 8, 2, 4096, 512, 4
  cache_bytes, update_bytes = b * k * s * h * 2, b * t * k * h * 2

  def write(cache, update_btkh, dest_bt):
    if kind == "scatter":
      rows = jnp.broadcast_to(jnp.arange(b)[:, None], dest_bt.shape)
      return cache.at[rows, :, dest_bt].set(update_btkh, mode="drop")
    return jax.lax.dynamic_update_slice(cache, update_btkh.transpose(0, 2, 1, 3),
                                        (0, 0, dest_bt[0, 0], 0))

  compiled = _compiled(write, mesh, ((b, k, s, h), jnp.bfloat16, P()),
                       ((b, t, k, h), jnp.bfloat16, P()), ((b, t), jnp.int32, P()), donate=(0,))
  got = hlo_traffic.hbm_bytes(compiled.as_text()).total
  assert got <= 3 * update_bytes + 4096, got  # the update read and written, the indices
  assert got < cache_bytes / 50


def test_gather_reads_its_rows_not_the_table(mesh):
  vocab, d, rows = 151936, 1024, 16
  compiled = _compiled(lambda table, ids: jnp.take(table, ids, axis=0), mesh,
                       ((vocab, d), jnp.bfloat16, P()), ((rows,), jnp.int32, P()))
  got = hlo_traffic.hbm_bytes(compiled.as_text()).total
  assert got <= 4 * rows * d * 2 + 4096, got
  assert got < vocab * d * 2 / 100


def test_scan_over_stacked_layers_counts_every_layer(mesh):
  layers, b, d = 12, 8, 1024

  def run(x, w_ldd):
    def body(x, w):
      return jnp.tanh(x @ w), None
    return jax.lax.scan(body, x, w_ldd)[0]

  compiled = _compiled(run, mesh, ((b, d), jnp.bfloat16, P()),
                       ((layers, d, d), jnp.bfloat16, P()))
  traffic = hlo_traffic.hbm_bytes(compiled.as_text())
  weights = layers * d * d * 2
  assert weights <= traffic.total <= 1.2 * weights, (traffic.total, weights)
  xla = compiled.cost_analysis()
  xla = (xla[0] if isinstance(xla, list) else xla)["bytes accessed"]
  assert xla < weights / 2  # the loop body counted once


def test_parse_reads_trip_counts_and_branches():
  hlo = """HloModule m

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024]{0} get-tuple-element(%p), index=1
  %y = f32[1024]{0} exponential(%x)
  ROOT %t = (s32[], f32[1024]{0}) tuple(%i, %y)
}

%cond (p.1: (s32[], f32[1024])) -> pred[] {
  %p.1 = (s32[], f32[1024]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[1024]{0}) tuple(%z, %a)
  %w = (s32[], f32[1024]{0}) while(%t0), condition=%cond, body=%body
  ROOT %r = f32[1024]{0} get-tuple-element(%w), index=1
}
"""
  # Seven trips of one exp over 4 KiB (read and write) and the loop test (two s32 in,
  # one pred out).
  traffic = hlo_traffic.hbm_bytes(hlo)
  assert traffic.by_label == {"exponential": 7 * 2 * 4096, "compare": 7 * 9}
  assert traffic.total == 7 * (2 * 4096 + 9)
  # A bound the program computes (carried in the loop's tuple) cannot be read: such a
  # loop counts the caller's `unknown_trips` (1 by default).
  traced = hlo.replace("%n = s32[] constant(7)", "%n = s32[] get-tuple-element(%p.1), index=0")
  assert hlo_traffic.hbm_bytes(traced).total == 2 * 4096 + 9
  assert hlo_traffic.hbm_bytes(traced, unknown_trips=5).total == 5 * (2 * 4096 + 9)
  assert hlo_traffic.hbm_bytes(hlo, unknown_trips=5).total == traffic.total
