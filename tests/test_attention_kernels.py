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

from configs import tiny_refusion
from refusion_jax import attention_kernels, masks, objective, sharding
from refusion_jax import config as config_lib
from refusion_jax.kv_cache import KVCache
from refusion_jax.model import Transformer, attend
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


def _outputs(model, batch, positions_bt, objective_name, mesh=None):
  """Logits of the tokens at `positions_bt`, and the loss and its gradients, in one jit."""
  graphdef, state = nnx.split(model)
  rules = sharding.ShardingRules()

  @jax.jit
  def run(state, batch, positions_bt):
    with sharding.use_mesh(mesh, rules):
      model = nnx.merge(graphdef, state)

      def loss(m):
        return objective.loss_fn(m, batch, jax.random.key(7), objective=objective_name,
                                 mask_id=3, pad_id=0)[0]

      value, grads = nnx.value_and_grad(loss)(model)
      return model(batch["tokens"], positions_bt), value, nnx.to_pure_dict(grads)

  with sharding.use_mesh(mesh, rules):
    jaxpr = str(jax.make_jaxpr(run)(state, batch, positions_bt))
  logits, loss, grads = run(state, batch, positions_bt)
  return jaxpr, np.asarray(logits), float(loss), grads


def _assert_trees_close(got, want, atol):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol,
                                                       rtol=0), got, want)


# The ARM trains through the very same causal kernel call as ReFusion (only its
# positions and labels differ), so the two ReFusion cases stand for it.
@pytest.mark.parametrize("objective_name,scan,remat", [
    ("refusion", False, "save_dots"), ("refusion", True, "full"), ("mdm", True, "none")])
def test_model_logits_loss_and_gradients_equal_the_einsum_path(objective_name, scan, remat):
  attention = objective.attention_for(objective_name)
  ref = Transformer(_config(scan_layers=scan, remat=remat, attention=attention), rngs=nnx.Rngs(1))
  fast = Transformer(_config("splash", scan_layers=scan, remat=remat, attention=attention),
               rngs=nnx.Rngs(1))
  batch = _batch()
  pos = jnp.stack([jax.random.permutation(jax.random.key(i), T) for i in range(4)])
  jaxpr, logits, loss, grads = _outputs(fast, batch, pos, objective_name)
  ref_jaxpr, want_logits, want_loss, want_grads = _outputs(ref, batch, pos, objective_name)
  assert "pallas_call" in jaxpr and "pallas_call" not in ref_jaxpr
  np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
  assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
  _assert_trees_close(grads, want_grads, 1e-5)


@pytest.mark.parametrize("data,fsdp,tensor", [(2, 2, 2), (1, 2, 4)])
def test_sharded_kernel_equals_the_unsharded_einsum_path(data, fsdp, tensor):
  # tensor=2 splits the 2 key/value heads with the 4 query heads; tensor=4 splits only the
  # query heads (each device then holds the key/value head its queries read).
  ref = Transformer(_config(), rngs=nnx.Rngs(2))
  batch = _batch(b=4, seed=1)
  pos = jnp.broadcast_to(jnp.arange(T)[None], (4, T))
  _, want_logits, want_loss, want_grads = _outputs(ref, batch, pos, "refusion")

  mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
  rules = sharding.ShardingRules()
  model = sharding.shard_model(Transformer(_config("splash"), rngs=nnx.Rngs(2)), mesh, rules)
  batch = {name: jax.device_put(x, sharding.data_sharding(mesh, rules, x.ndim))
           for name, x in batch.items()}
  jaxpr, logits, loss, grads = _outputs(model, batch, pos, "refusion", mesh)
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr
  np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
  assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
  _assert_trees_close(grads, want_grads, 1e-5)


def test_explicit_masks_and_decode_passes_keep_the_einsum_path():
  ref = Transformer(_config(), rngs=nnx.Rngs(3))
  fast = Transformer(_config("splash"), rngs=nnx.Rngs(3))
  ids = _batch(b=2)["tokens"][:, :40]  # not a tile multiple: only the einsum path takes it
  pos = jnp.broadcast_to(jnp.arange(40)[None], (2, 40))
  mask_btt = masks.prefix_causal_btt(jnp.array([40, 25]), 40)
  graphdef, state = nnx.split(fast)

  def masked(state, ids, pos):
    return nnx.merge(graphdef, state)(ids, pos, mask_btt)

  def chunk(state, ids, pos):
    model = nnx.merge(graphdef, state)
    return model.forward_chunk(ids, pos, KVCache.init(model.config, 2, 64), mask_btt)[0]

  for fn in (masked, chunk):
    assert "pallas_call" not in str(jax.make_jaxpr(fn)(state, ids, pos))
  np.testing.assert_array_equal(np.asarray(fast(ids, pos, mask_btt)),
                                np.asarray(ref(ids, pos, mask_btt)))


def _train_config(**model):
  c = tiny_refusion.get_config()
  for name, value in model.items():
    c.model[name] = value
  return c


def test_untileable_sequence_length_is_refused():
  c = _train_config(attention_impl="splash")
  c.data.seq_len = 200
  with pytest.raises(ValueError, match=r"config.model.attention_impl='splash' needs a sequence "
                     r"length that is a multiple of its 128-token tile, got 200 \(use 256"):
    settings.resolve(c)
  c.data.seq_len = 256
  assert settings.resolve(c).model_config.attention_impl == "splash"
  # A direct call refuses before tracing any kernel, naming the field.
  model = Transformer(_config("splash"), rngs=nnx.Rngs(0))
  ids = jnp.zeros((1, 100), jnp.int32)
  with pytest.raises(ValueError, match="ModelConfig.attention_impl='splash' needs .* got 100"):
    model(ids, jnp.broadcast_to(jnp.arange(100)[None], (1, 100)))


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_is_as_close_to_float32_as_the_bf16_einsum_path(causal):
  """On a GPU: cuDNN's output and gradients (bf16, GQA, a padded row) are within 2x of
  the bf16 einsum path's error against float32 on the same values, and both under 1e-2."""
  q, k, v = _qkv(jnp.bfloat16, n=8, k=4)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  length_b = jnp.array([256, 150], jnp.int32)
  mask_btt = _reference_mask(length_b, 256, causal)
  valid = (jnp.arange(256)[None, :] < length_b[:, None])[:, :, None, None]
  cudnn = lambda q, k, v: attention_kernels.attend_full(  # noqa: E731
      q, k, v, impl="cudnn", causal=causal, length_b=length_b)
  einsum = lambda q, k, v: attend(q, k, v, mask_btt)  # noqa: E731

  def out_and_grads(fn, q, k, v):
    loss = lambda q, k, v: jnp.sum(jnp.sin(  # noqa: E731
        jnp.where(valid, fn(q, k, v), 0.0).astype(jnp.float32)))
    return jax.jit(fn)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  sel = np.asarray(valid[:, :, 0, 0])
  (o_cu, g_cu), (o_bf, g_bf), (o_32, g_32) = (
      out_and_grads(cudnn, q, k, v), out_and_grads(einsum, q, k, v),
      out_and_grads(einsum, q32, k32, v32))
  assert o_cu.dtype == jnp.bfloat16
  pairs = [(np.asarray(o_cu, np.float32)[sel], np.asarray(o_bf, np.float32)[sel],
            np.asarray(o_32)[sel])] + list(zip(g_cu, g_bf, g_32))
  for got, bf, want in pairs:
    err, bf_err = _rel(got, want), _rel(bf, want)
    assert err < 1e-2 and err < 2 * bf_err + 1e-4, (err, bf_err)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal off a GPU")
def test_cudnn_is_refused_off_gpu():
  c = _train_config(attention_impl="cudnn", dtype="bfloat16")
  with pytest.raises(ValueError, match="config.model.attention_impl='cudnn' runs on NVIDIA GPUs "
                     "only, but the devices are 'cpu'"):
    settings.resolve(c)
  with pytest.raises(ValueError, match="needs a bfloat16 or float16 compute dtype"):
    attention_kernels.check_supported("cudnn", seq_len=128, dtype="float32", platform="gpu")
  model = Transformer(_config("cudnn", dtype="bfloat16"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="'cudnn' runs on NVIDIA GPUs only"):
    model(jnp.zeros((1, T), jnp.int32), jnp.broadcast_to(jnp.arange(T)[None], (1, T)))
  q, k, v = _qkv(jnp.bfloat16, t=T)
  with pytest.raises(ValueError, match="'cudnn' runs on NVIDIA GPUs only"):
    attention_kernels.attend_full(q, k, v, impl="cudnn")
  with pytest.raises(ValueError, match="the einsum reference is model.attend"):
    attention_kernels.attend_full(q, k, v, impl="xla")


def test_tpu_training_program_holds_the_splash_kernel():
  # Compiled for a v5e 2x2 slice without a TPU, at a small shape (the mechanism). How much
  # scratch splash saves shows at 4096 tokens and more, where the einsum path keeps each
  # row's [heads, T, T] float32 scores; that compile takes about a minute, so it is
  # measured by benchmarks/attention_memory.py (docs/RESULTS.md), not here.
  topologies = pytest.importorskip("jax.experimental.topologies")
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=1, devices=devices)
  rules = sharding.ShardingRules()
  b, t = 4, 512
  row = sharding.data_sharding(mesh, rules, 1)
  batch = {"tokens": jax.ShapeDtypeStruct((b, t), jnp.int32,
                                          sharding=sharding.data_sharding(mesh, rules)),
           "prompt_len": jax.ShapeDtypeStruct((b,), jnp.int32, sharding=row),
           "response_len": jax.ShapeDtypeStruct((b,), jnp.int32, sharding=row)}
  cfg = _config("splash", num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=1,
                head_dim=128, mlp_dim=256, max_position_embeddings=t, dtype="bfloat16")
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       abstract, sharding.state_shardings(abstract, mesh, rules))

  def step(state, batch):
    with sharding.use_mesh(mesh, rules):
      def loss(m):
        return objective.loss_fn(m, batch, jax.random.key(0), objective="refusion",
                                 mask_id=3, pad_id=0)[0]
      return nnx.value_and_grad(loss)(nnx.merge(graphdef, state))

  compiled = jax.jit(step).lower(state, batch).compile()
  # The Mosaic kernel itself, not its interpreted form, is in the TPU program (forward
  # and backward), and the program fits a v5e chip's 16 GiB.
  assert compiled.as_text().count("tpu_custom_call") >= 2
  mem = compiled.memory_analysis()
  assert 0 < mem.temp_size_in_bytes + mem.argument_size_in_bytes < 16 * 2**30
