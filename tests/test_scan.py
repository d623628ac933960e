"""Scanned layers (`ModelConfig.scan_layers`): the same model as the unrolled one.

The unrolled model is the reference: a scanned model from the same seed holds
the same values stacked, and gives the same logits, losses, gradients, decoded
tokens and HF files; conversions between the layouts keep every value.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from refusion_jax import checkpoint, hf, objective, sharding
from refusion_jax import config as config_lib
from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache
from refusion_jax.model import Transformer, convert_layer_layout

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


def _config(scan, **changes):
  base = dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
              mlp_dim=96, max_position_embeddings=256, scan_layers=scan)
  base.update(changes)
  return config_lib.tiny(**base)


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _pair(**changes):
  return (Transformer(_config(False, **changes), rngs=nnx.Rngs(3)),
          Transformer(_config(True, **changes), rngs=nnx.Rngs(3)))


def test_same_seed_gives_the_same_values_stacked():
  unrolled, scanned = _pair()
  a, b = _params(unrolled), _params(scanned)
  for i in range(3):
    jax.tree.map(lambda x, y, i=i: np.testing.assert_array_equal(np.asarray(x),
                                                                  np.asarray(y)[i]),
                 a["layers"][i], b["layers"])
  np.testing.assert_array_equal(np.asarray(a["embed"]), np.asarray(b["embed"]))
  # Every stacked parameter carries the "layers" logical axis first.
  flat = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
  for path, var in flat.items():
    if path[0] == "layers":
      assert var.logical_axes[0] == "layers" and var.get_value().shape[0] == 3, path
  # The layouts convert into each other without changing a value.
  back = convert_layer_layout(b, 3, scanned=False)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, back)
  again = convert_layer_layout(a, 3, scanned=True)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), b, again)
  with pytest.raises(ValueError, match="already per layer"):
    convert_layer_layout(a, 3, scanned=False)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_logits_and_cache_pass_equal_the_unrolled_model(model_type):
  unrolled, scanned = _pair(model_type=model_type)
  rs = np.random.RandomState(0)
  ids = jnp.asarray(rs.randint(0, 512, (2, 10)))
  pos = jnp.asarray(np.stack([rs.permutation(10) for _ in range(2)]))
  np.testing.assert_allclose(np.asarray(scanned(ids, pos)), np.asarray(unrolled(ids, pos)),
                             atol=1e-5, rtol=0)
  # A chunk against a KV buffer: the scanned model reads its stacked cache.
  outs = []
  for model in (unrolled, scanned):
    cache = KVCache.init(model.config, 2, 16)
    assert cache.stacked == model.config.scan_layers
    mask = jnp.ones((2, 6, 6), bool)
    _, k, v = model.forward_chunk(ids[:, :6], pos[:, :6], cache, mask)
    cache = cache.commit(k, v, pos[:, :6], jnp.ones((2, 6), bool))
    logits, k2, _ = model.forward_chunk(ids[:, 6:], pos[:, 6:], cache,
                                        jnp.tril(jnp.ones((2, 4, 4), bool)))
    outs.append((np.asarray(logits), np.asarray(k2),
                 np.stack([np.asarray(cache.layer(i)[0]) for i in range(3)])))
  for a, b in zip(*outs):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _batch(rs, b=4, length=24):
  prompt = rs.randint(2, 6, b)
  response = rs.randint(4, 12, b)
  tokens = rs.randint(4, 512, (b, length))
  return {"tokens": jnp.asarray(tokens, jnp.int32), "prompt_len": jnp.asarray(prompt, jnp.int32),
          "response_len": jnp.asarray(response, jnp.int32)}


@pytest.mark.parametrize("objective_name, remat", [
    ("refusion", "none"), ("refusion", "full"), ("arm", "save_dots"), ("mdm", "none")])
def test_loss_and_gradients_equal_the_unrolled_model(objective_name, remat):
  attention = objective.attention_for(objective_name)
  unrolled, scanned = _pair(attention=attention, remat=remat)
  batch = _batch(np.random.RandomState(1))
  kwargs = dict(objective=objective_name, mask_id=3, pad_id=0, slot_sizes=(2, 4))

  def value_and_grads(model):
    graphdef, params = nnx.split(model)
    def loss(p):
      return objective.loss_fn(nnx.merge(graphdef, p), batch, jax.random.key(5), **kwargs)[0]
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, nnx.to_pure_dict(grads)

  v0, g0 = value_and_grads(unrolled)
  v1, g1 = value_and_grads(scanned)
  np.testing.assert_allclose(float(v1), float(v0), atol=1e-5, rtol=0)
  g1 = convert_layer_layout(g1, 3, scanned=False)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5,
                                                       rtol=0), g1, g0)


@pytest.mark.parametrize("dc", [
    DecodeConfig(method="refusion", gen_length=16, slot_size=4, block_size=8,
                 slot_threshold=0.3, token_threshold=0.2),
    DecodeConfig(method="ar", gen_length=12, slot_size=4, block_size=12),
    DecodeConfig(method="mdm", gen_length=8, block_size=4, slot_size=4),
    # Each finished block's K/V written inside the scan, in the next block's first pass.
    DecodeConfig(method="bd3lm", gen_length=12, block_size=4, slot_size=4,
                 mdm_tokens_per_step=2),
    # Verified infill and re-masking: entries moved within the stacked buffer.
    DecodeConfig(method="refusion", gen_length=16, slot_size=4, block_size=16,
                 slot_threshold=0.0, token_threshold=0.2, verify="correct", remask=True,
                 remask_threshold=0.9),
], ids=lambda dc: dc.method + ("-options" if dc.remask else ""))
def test_decoded_tokens_equal_the_unrolled_model(dc):
  attention = "bidirectional" if dc.method == "mdm" else "causal"
  unrolled, scanned = _pair(attention=attention)
  rs = np.random.RandomState(2)
  ids = rs.randint(4, 512, (3, 6))
  lens = np.asarray([6, 3, 5])
  a = engine.generate(unrolled, ids, lens, dc)
  b = engine.generate(scanned, ids, lens, dc)
  np.testing.assert_array_equal(np.asarray(b.tokens_bg), np.asarray(a.tokens_bg))
  np.testing.assert_array_equal(np.asarray(b.length_b), np.asarray(a.length_b))
  for name, value in a.counters.as_dict().items():
    np.testing.assert_array_equal(np.asarray(b.counters.as_dict()[name]), np.asarray(value),
                                  err_msg=name)
  if dc.remask:
    assert int(np.asarray(a.counters.remasked_b).sum()) > 0


def test_sharded_scanned_model_equals_unsharded():
  _, scanned = _pair()
  rs = np.random.RandomState(4)
  ids = jnp.asarray(rs.randint(0, 512, (4, 8)))
  pos = jnp.broadcast_to(jnp.arange(8), (4, 8))
  want = np.asarray(scanned(ids, pos))
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  placed = sharding.shard_model(scanned, mesh)
  q = dict(nnx.to_flat_state(nnx.state(placed, nnx.Param)))[("layers", "attn", "q_proj")]
  # [layers, embed, heads, head_dim]: layers replicated, embed over fsdp, heads over tensor.
  assert q.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  graphdef, state = nnx.split(placed)

  @jax.jit
  def run(state, ids, pos):
    return nnx.merge(graphdef, state)(ids, pos)

  with sharding.use_mesh(mesh):
    got = np.asarray(run(state, ids, pos))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gqa", "tied", "qwen2_gqa"])
def test_hf_round_trip_with_scanned_parameters_is_byte_equal(tmp_path, name):
  folder = os.path.join(FIXTURES, name)
  config, scanned = hf.load(folder, scan_layers=True)
  assert config.scan_layers
  q = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))[("layers", "attn", "q_proj")]
  assert q.get_value().shape[0] == config.num_layers
  _, unrolled = hf.load(folder)
  golden = np.load(os.path.join(folder, "golden.npz"))
  np.testing.assert_allclose(np.asarray(scanned(golden["input_ids"], golden["positions_perm"])),
                             golden["logits_perm"], atol=1e-4, rtol=0)
  hf.save(config, scanned, tmp_path / "out")
  hf.save(config.replace(scan_layers=False), unrolled, tmp_path / "ref")
  # Every tensor byte-equal to the original file, and the very same file as the
  # unrolled model's export.
  with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f, \
      safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as g:
    assert sorted(f.keys()) == sorted(g.keys())
    for key in f.keys():
      a, b = f.get_tensor(key), g.get_tensor(key)
      assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), key
  for file_name in ("model.safetensors", "config.json"):
    assert (tmp_path / "out" / file_name).read_bytes() == (tmp_path / "ref" / file_name).read_bytes()
  # Loaded onto a mesh, each device reads only its slices of the layer tensors.
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  _, placed = hf.load(folder, scan_layers=True, mesh=mesh)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               _params(placed), _params(scanned))


def test_model_folder_loads_in_either_layout(tmp_path):
  unrolled, scanned = _pair()
  checkpoint.save_model(str(tmp_path / "m"), unrolled.config, unrolled)
  config, loaded = checkpoint.load_model(str(tmp_path / "m"), scan_layers=True)
  assert config.scan_layers and config.replace(scan_layers=False) == unrolled.config
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               _params(loaded), _params(scanned))
  checkpoint.save_model(str(tmp_path / "s"), scanned.config, scanned)
  config, back = checkpoint.load_model(str(tmp_path / "s"), scan_layers=False)
  assert not config.scan_layers
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               _params(back), _params(unrolled))
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  _, placed = checkpoint.load_model(str(tmp_path / "m"), mesh=mesh, scan_layers=True)
  assert isinstance(jax.tree.leaves(_params(placed))[0].sharding, jax.sharding.NamedSharding)
