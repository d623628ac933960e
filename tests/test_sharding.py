"""Sharding rules and the sharded forward pass on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from refusion_jax import config as config_lib
from refusion_jax import model as model_lib
from refusion_jax import sharding


def test_logical_to_physical_maps_names():
  rules = sharding.ShardingRules()
  assert sharding.logical_to_physical(("embed", "mlp"), rules) == P("fsdp", "tensor")
  assert sharding.logical_to_physical(("batch", "seq", "act_embed"), rules) == P(
      ("data", "fsdp"), None, None)
  assert sharding.logical_to_physical((None, "norm"), rules) == P(None, None)


def test_two_logical_axes_on_one_mesh_axis_raise():
  rules = sharding.ShardingRules(embed="tensor")
  with pytest.raises(ValueError, match="'embed' and 'mlp' both map to mesh axis 'tensor'"):
    sharding.logical_to_physical(("embed", "mlp"), rules)


def test_bad_rules_raise():
  with pytest.raises(ValueError, match="ShardingRules.mlp='model'"):
    sharding.ShardingRules(mlp="model")
  with pytest.raises(ValueError, match="unknown logical axis"):
    sharding.ShardingRules.from_mapping({"hidden": "fsdp"})
  with pytest.raises(ValueError, match="no sharding rule"):
    sharding.logical_to_physical(("nonsense",), sharding.ShardingRules())


def test_indivisible_dimension_is_replicated():
  mesh = sharding.make_mesh(data=1, fsdp=2, tensor=4)
  spec = sharding.logical_to_physical(("embed", "kv_heads", "head_dim"), sharding.ShardingRules(),
                                      shape=(64, 2, 16), mesh=mesh)
  assert spec == P("fsdp", None, None)


def test_make_mesh_sizes_and_errors():
  assert jax.device_count() == 8
  mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(sharding.make_mesh(1, 1, -1).shape)["tensor"] == 8
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh(data=2, fsdp=4, tensor=2)
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    sharding.make_mesh(data=-1, fsdp=-1, tensor=1)
  with pytest.raises(ValueError, match="not divisible"):
    sharding.make_mesh(data=3, fsdp=-1, tensor=1)


def _tiny(**kw):
  return config_lib.tiny(num_layers=2, vocab_size=256, hidden_size=64, num_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_dim=128, **kw)


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_forward_matches_unsharded(tie):
  cfg = _tiny(tie_embeddings=tie)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(1), (4, 24), 0, cfg.vocab_size)
  perm = jnp.stack([jax.random.permutation(jax.random.key(i), 24) for i in range(4)])
  expected = np.asarray(model(ids, perm))

  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  rules = sharding.ShardingRules()
  graphdef, state = nnx.split(sharding.shard_model(model, mesh, rules))
  q = state["layers"][0]["attn"]["q_proj"]
  assert q[...].sharding.spec == P("fsdp", "tensor", None)
  assert len(q[...].addressable_shards) == 8

  in_sharding = sharding.data_sharding(mesh, rules)

  @jax.jit
  def forward(state, ids, pos):
    with sharding.use_mesh(mesh, rules):
      return nnx.merge(graphdef, state)(ids, pos)

  logits = forward(state, jax.device_put(ids, in_sharding), jax.device_put(perm, in_sharding))
  assert logits.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)
