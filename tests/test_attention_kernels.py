"""Memory-efficient attention kernels (`ModelConfig.attention_impl`) against the einsum path.

The einsum reference `model.attend` is the oracle: the splash kernel (Pallas
interpret mode on the CPU) gives the same attention, the same logits, losses
and gradients, unrolled and scanned, under every remat policy and on a sharded
mesh. A program compiled for a real TPU slice holds less scratch with it.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from configs import tiny_refusion
from refusion_jax import attention_kernels, masks, objective, sharding
from refusion_jax import config as config_lib
from refusion_jax.kv_cache import KVCache
from refusion_jax.model import Qwen3, attend
from refusion_jax.training import settings

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

T = 128  # one splash tile: the shortest row the kernel takes


def _qkv(dtype, b=2, t=256, n=4, k=2, h=128, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(key, (b, t, heads, h), jnp.float32).astype(dtype)
               for key, heads in zip(keys, (n, k, k)))


def _reference_mask(length_b, t, causal):
  if causal:
    return masks.prefix_causal_btt(length_b, t)
  valid_bt = jnp.arange(t)[None, :] < length_b[:, None]
  return jnp.broadcast_to(valid_bt[:, None, :], (len(length_b), t, t)) | jnp.eye(t, dtype=bool)


def _runs_kernel(model, ids, pos) -> bool:
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s, i, p: nnx.merge(graphdef, s)(i, p))(state, ids, pos)
  return "pallas_call" in str(jaxpr)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_splash_equals_reference_with_padding_and_gqa(dtype, atol, causal):
  q, k, v = _qkv(dtype)  # 4 query heads over 2 key/value heads, head_dim 128
  length_b = jnp.array([256, 150], jnp.int32)
  mask_btt = _reference_mask(length_b, 256, causal)
  got = attention_kernels.attend_full(q, k, v, impl="splash", causal=causal, length_b=length_b)
  want = attend(q, k, v, mask_btt)
  assert got.dtype == dtype
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got[0], want[0], atol=atol, rtol=0)
  np.testing.assert_allclose(got[1, :150], want[1, :150], atol=atol, rtol=0)
  # A padding query is alone in its segment: its output is its own value (kv head n // 2).
  own_value = np.repeat(np.asarray(v[1, 150:], np.float32), 2, axis=1)
  np.testing.assert_allclose(got[1, 150:], own_value, atol=atol, rtol=0)
  if dtype == jnp.float32:
    def loss(fn):
      return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
    # The padding rows' outputs stop here in both, so every gradient must agree.
    valid_b1t1 = (jnp.arange(256)[None, :] < length_b[:, None])[:, :, None, None]
    want_grads = jax.grad(loss(lambda q, k, v: jnp.where(valid_b1t1, attend(q, k, v, mask_btt),
                                                         0.0)), argnums=(0, 1, 2))(q, k, v)
    grads = jax.grad(loss(lambda q, k, v: jnp.where(valid_b1t1, attention_kernels.attend_full(
        q, k, v, impl="splash", causal=causal, length_b=length_b), 0.0)), argnums=(0, 1, 2))(
            q, k, v)
    for g, w in zip(grads, want_grads):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5, rtol=1e-5)


def _config(impl="xla", **changes):
  base = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
              mlp_dim=96, vocab_size=256, max_position_embeddings=512, attention_impl=impl)
  base.update(changes)
  return config_lib.tiny(**base)


def _batch(b=4, t=T, seed=0):
  rs = np.random.RandomState(seed)
  prompt_len = rs.randint(1, t // 4, b)
  response_len = np.minimum(rs.randint(t // 4, t, b), t - prompt_len)
  response_len[0] = t - prompt_len[0]  # one row without padding
  return {"tokens": jnp.asarray(rs.randint(4, 256, (b, t)), jnp.int32),
          "prompt_len": jnp.asarray(prompt_len, jnp.int32),
          "response_len": jnp.asarray(response_len, jnp.int32)}


def _loss_and_grads(model, batch, objective_name):
  def loss(m):
    return objective.loss_fn(m, batch, jax.random.key(7), objective=objective_name, mask_id=3,
                             pad_id=0)[0]
  value, grads = nnx.value_and_grad(loss)(model)
  return float(value), nnx.to_pure_dict(grads)


def _assert_trees_close(got, want, atol):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol,
                                                       rtol=0), got, want)


@pytest.mark.parametrize("objective_name,scan,remat", [
    ("refusion", False, "none"), ("refusion", True, "full"), ("arm", False, "save_dots"),
    ("mdm", True, "save_dots")])
def test_model_logits_loss_and_gradients_equal_the_einsum_path(objective_name, scan, remat):
  attention = objective.attention_for(objective_name)
  ref = Qwen3(_config(scan_layers=scan, remat=remat, attention=attention), rngs=nnx.Rngs(1))
  fast = Qwen3(_config("splash", scan_layers=scan, remat=remat, attention=attention),
               rngs=nnx.Rngs(1))
  batch = _batch()
  ids = batch["tokens"]
  pos = jnp.stack([jax.random.permutation(jax.random.key(i), T) for i in range(4)])
  assert _runs_kernel(fast, ids, pos)
  assert not _runs_kernel(ref, ids, pos)
  np.testing.assert_allclose(np.asarray(fast(ids, pos)), np.asarray(ref(ids, pos)), atol=1e-5,
                             rtol=0)
  loss, grads = _loss_and_grads(fast, batch, objective_name)
  want_loss, want_grads = _loss_and_grads(ref, batch, objective_name)
  assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
  _assert_trees_close(grads, want_grads, 1e-5)


@pytest.mark.parametrize("data,fsdp,tensor", [(2, 2, 2), (1, 2, 4)])
def test_sharded_kernel_equals_the_unsharded_einsum_path(data, fsdp, tensor):
  # tensor=2 splits the 2 key/value heads with the 4 query heads; tensor=4 splits only the
  # query heads (each device then holds the key/value head its queries read).
  ref = Qwen3(_config(), rngs=nnx.Rngs(2))
  batch = _batch(b=4, seed=1)
  want_loss, want_grads = _loss_and_grads(ref, batch, "refusion")

  mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
  rules = sharding.ShardingRules()
  model = sharding.shard_model(Qwen3(_config("splash"), rngs=nnx.Rngs(2)), mesh, rules)
  graphdef, state = nnx.split(model)
  batch = jax.device_put(batch, sharding.data_sharding(mesh, rules, ndim=1))
  batch["tokens"] = jax.device_put(batch["tokens"], sharding.data_sharding(mesh, rules))

  run = _jit_loss(graphdef, mesh, rules)
  with sharding.use_mesh(mesh, rules):
    jaxpr = str(jax.make_jaxpr(run)(state, batch))
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr
  loss, grads = run(state, batch)
  assert abs(float(loss) - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
  _assert_trees_close(grads, want_grads, 1e-5)


def _jit_loss(graphdef, mesh, rules):
  @jax.jit
  def run(state, batch):
    with sharding.use_mesh(mesh, rules):
      def loss(m):
        return objective.loss_fn(m, batch, jax.random.key(7), objective="refusion", mask_id=3,
                                 pad_id=0)[0]
      value, grads = nnx.value_and_grad(loss)(nnx.merge(graphdef, state))
      return value, nnx.to_pure_dict(grads)
  return run
