"""Model folders (save_model / load_model) and the trainers' CheckpointManager."""

import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from refusion_jax import checkpoint, sharding
from refusion_jax import config as config_lib
from refusion_jax.model import Transformer


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_save_model_load_model_round_trip(tmp_path):
  config = config_lib.tiny(num_layers=1, tie_embeddings=False)
  model = Transformer(config, rngs=nnx.Rngs(3))
  directory = str(tmp_path / "model")
  checkpoint.save_model(directory, config, model)
  with pytest.raises(FileExistsError, match="already exists"):
    checkpoint.save_model(directory, config, model)
  loaded_config, loaded = checkpoint.load_model(directory)
  assert loaded_config == config
  jax.tree.map(np.testing.assert_array_equal, _params(loaded), _params(model))
  # Only the finished folder is left: no temporary folder beside it.
  assert os.listdir(tmp_path) == ["model"]

  mesh = sharding.make_mesh(1, 4, 2)
  _, sharded = checkpoint.load_model(directory, mesh=mesh)
  assert sharded.layers[0].mlp.up_proj[...].sharding.spec == P("fsdp", "tensor")
  jax.tree.map(np.testing.assert_array_equal, _params(sharded), _params(model))


def _iterator():
  # A grain iterator whose batches say where they come from: batch i is [4i, 4i + 4).
  return iter(grain.MapDataset.range(400).batch(4).to_iter_dataset())


def _state(mesh, scale):
  params = {"w": jnp.arange(64.0).reshape(8, 8) * scale, "layers": {0: {"b": jnp.ones(8) * scale}}}
  spec = {"w": P("fsdp", "tensor"), "layers": {0: {"b": P(None)}}}
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, spec,
                        is_leaf=lambda x: isinstance(x, P))
  return {"params": params, "opt_state": optax.adamw(1e-3).init(params)}


def test_train_checkpointer_round_trip_keeps_last_n_and_data_position(tmp_path):
  mesh = sharding.make_mesh(1, 4, 2)
  directory = str(tmp_path / "ckpt")
  it = _iterator()
  with checkpoint.TrainCheckpointer(directory, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    for step in (1, 2, 3):
      next(it)
      ckpt.save(step, _state(mesh, step), it, {"seed": 5})
      # Training goes on while the save runs: the saved position must not move.
      next(it)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3

  # Restore into a different layout (replicated on one device).
  one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  wanted = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(one, P())),
      _state(mesh, 0))
  fresh = _iterator()
  with checkpoint.TrainCheckpointer(directory, max_to_keep=2) as ckpt:
    assert ckpt.read_meta(3) == {"seed": 5, "step": 3}
    state, meta = ckpt.restore(3, wanted, fresh)
  assert meta == {"seed": 5, "step": 3}
  expected = _state(mesh, 3)
  assert jax.tree.structure(state) == jax.tree.structure(expected)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state,
               expected)
  assert state["params"]["w"].sharding == NamedSharding(one, P())
  # Saved after batches 0, 1, 2, 3, 4 were drawn (two per earlier step, one before
  # this save): the next batch is batch 5, i.e. rows 20..23.
  np.testing.assert_array_equal(next(fresh), np.arange(20, 24))


def test_train_checkpointer_restores_a_data_loader_iterator(tmp_path):
  # grain.DataLoader iterators keep their state as bytes (the trainer's loader).
  source = grain.sources.RangeDataSource(0, 50, 1)
  sampler = grain.samplers.IndexSampler(num_records=50, shuffle=True, seed=3, num_epochs=None,
                                        shard_options=grain.sharding.NoSharding())

  def loader():
    return iter(grain.DataLoader(data_source=source, sampler=sampler, worker_count=0,
                                 operations=[grain.transforms.Batch(5)]))

  reference = [next(it) for it in [loader()] for _ in range(9)]
  it = loader()
  for _ in range(4):
    next(it)
  mesh = sharding.make_mesh(1, 4, 2)
  state = _state(mesh, 1)
  with checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=1) as ckpt:
    ckpt.save(4, state, it, {})
  resumed = loader()
  with checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=1) as ckpt:
    ckpt.restore(4, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state), resumed)
  for expected in reference[4:]:
    np.testing.assert_array_equal(next(resumed), expected)


def test_train_checkpointer_rejects_bad_max_to_keep(tmp_path):
  with pytest.raises(ValueError, match="checkpoint.max_to_keep must be a positive int, got 0"):
    checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=0)


def test_unfinished_save_is_ignored_and_cleaned(tmp_path):
  # What a kill -9 in the middle of an asynchronous save leaves behind.
  mesh = sharding.make_mesh(1, 4, 2)
  it = _iterator()
  with checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=3) as ckpt:
    ckpt.save(2, _state(mesh, 2), it, {})
  partial = tmp_path / "4.orbax-checkpoint-tmp-1234567"
  (partial / "state").mkdir(parents=True)
  with checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=3) as ckpt:
    assert ckpt.latest_step() == 2
    # The resumed run reaches step 4 again; its save replaces the leftover.
    ckpt.save(4, _state(mesh, 4), it, {})
  assert not partial.exists()
  assert sorted(os.listdir(tmp_path)) == ["2", "4"]


def test_checkpoints_without_a_data_item(tmp_path):
  # Trainers whose batches are a function of (seed, step) save no iterator position.
  mesh = sharding.make_mesh(1, 4, 2)
  state = _state(mesh, 2)
  with checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=2, with_data=False) as ckpt:
    with pytest.raises(ValueError, match="with_data=False take no data iterator"):
      ckpt.save(1, state, _iterator(), {})
    ckpt.save(2, state, None, {"seed": 5})
  assert sorted(n for n in os.listdir(tmp_path / "2") if (tmp_path / "2" / n).is_dir()) == [
      "meta", "state"]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  with checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=2, with_data=False) as ckpt:
    assert ckpt.damage(2) is None  # no data folder is no damage here
    restored, meta = ckpt.restore(2, abstract, None)
  assert meta == {"seed": 5, "step": 2}
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               restored, state)
  # A trainer that reads an iterator finds the data item missing: the checkpoint is damaged.
  with checkpoint.TrainCheckpointer(str(tmp_path), max_to_keep=2) as ckpt:
    assert ckpt.damage(2) == "its 'data' folder is missing"
