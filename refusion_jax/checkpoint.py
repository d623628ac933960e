"""Checkpoints of refusion_jax.

`save_model` / `load_model`: a self-describing model folder (our
`model_config.json` + an orbax checkpoint of the parameters). Writes go to a
temporary folder renamed into place, so a crash never leaves half a model.

`TrainCheckpointer`: the trainer's orbax CheckpointManager (parameters,
optimizer state, step/seed and the data iterator position).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

from refusion_jax import sharding
from refusion_jax.config import ModelConfig

MODEL_CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"


def save_model(directory: str, config: ModelConfig, model: nnx.Module, overwrite: bool = False):
  """Writes `directory/model_config.json` and `directory/params` atomically."""
  directory = os.path.abspath(directory)
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(f"{directory} already exists (pass overwrite=True to replace it)")
  parent = os.path.dirname(directory)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp_model_", dir=parent)
  try:
    with open(os.path.join(tmp, MODEL_CONFIG_FILE), "w") as f:
      json.dump(dataclasses.asdict(config), f, indent=2)
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(os.path.join(tmp, PARAMS_DIR), state)
      ckptr.wait_until_finished()
    if os.path.exists(directory):
      shutil.rmtree(directory)
    os.replace(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def read_model_config(directory: str) -> ModelConfig:
  path = os.path.join(directory, MODEL_CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no {MODEL_CONFIG_FILE} in {directory}: not a refusion_jax model folder")
  with open(path) as f:
    return ModelConfig(**json.load(f))


def is_model_dir(directory: str) -> bool:
  return os.path.exists(os.path.join(directory, MODEL_CONFIG_FILE))


def load_model(directory: str, mesh=None, rules: sharding.ShardingRules | None = None):
  """Returns `(config, model)`, parameters placed on `mesh` when one is given."""
  from refusion_jax.model import Qwen3  # local: model imports are heavy-ish

  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"model folder {directory} does not exist")
  config = read_model_config(directory)
  abstract = nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  if mesh is not None:
    shardings = sharding.state_shardings(abstract_state, mesh, rules or sharding.ShardingRules())
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state,
        shardings)
  else:
    target = abstract_state
  with ocp.StandardCheckpointer() as ckptr:
    state = ckptr.restore(os.path.join(directory, PARAMS_DIR), target)
  return config, nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------
# Training checkpoints: an orbax CheckpointManager over three items.
#
#   state  params + optimizer state (one pytree; restored straight into the
#          target shardings)
#   meta   JSON: step, seed and what the run must keep constant to resume
#   data   the grain iterator position, one JSON file per JAX process
#
# Each step folder is written under a temporary name and renamed into place
# by orbax, so a killed run leaves only complete checkpoints behind.

STATE_ITEM = "state"
META_ITEM = "meta"
DATA_ITEM = "data"


class _IteratorSnapshot:
  """The data iterator's position, captured when the save is requested.

  An asynchronous save may serialise its items after training has moved on;
  reading the live iterator then would record a later position than the
  parameters saved beside it.
  """

  def __init__(self, iterator):
    state = iterator.get_state()
    # grain's handler stores bytes as text and JSON-decodes for dataset iterators.
    self._state = state if isinstance(state, bytes) else json.dumps(state).encode()

  def get_state(self) -> bytes:
    return self._state


class TrainCheckpointer:
  """Keeps the last `max_to_keep` training checkpoints under `directory`."""

  def __init__(self, directory: str, *, max_to_keep: int, async_save: bool = True):
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f"checkpoint.max_to_keep must be a positive int, got {max_to_keep!r}")
    self.directory = os.path.abspath(directory)
    # cleanup_tmp_directories: a save cut short by a kill leaves a temporary folder
    # that is never a valid step; orbax removes it (in the background, finished
    # before the next save) when the next run opens the manager.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=bool(async_save),
        cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            META_ITEM: ocp.JsonCheckpointHandler(),
            DATA_ITEM: grain.checkpoint.CheckpointHandler(),
        })

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state, data_iterator, meta: dict) -> None:
    """Starts saving `state` (a pytree of arrays), `meta` and the iterator position."""
    args = ocp.args.Composite(**{
        STATE_ITEM: ocp.args.StandardSave(state),
        META_ITEM: ocp.args.JsonSave(dict(meta, step=int(step))),
        DATA_ITEM: grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iterator)),
    })
    # force: the trainer decides when to save; orbax's interval logic stays out.
    self._manager.save(int(step), args=args, force=True)

  def read_meta(self, step: int) -> dict:
    restored = self._manager.restore(
        int(step), args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
    return dict(restored[META_ITEM])

  def restore(self, step: int, abstract_state, data_iterator):
    """Returns `(state, meta)` and moves `data_iterator` to the saved position.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` whose `sharding`
    says where each restored array goes.
    """
    restored = self._manager.restore(int(step), args=ocp.args.Composite(**{
        STATE_ITEM: ocp.args.StandardRestore(abstract_state),
        META_ITEM: ocp.args.JsonRestore(),
        DATA_ITEM: grain.checkpoint.CheckpointRestore(data_iterator),
    }))
    return restored[STATE_ITEM], dict(restored[META_ITEM])

  def wait(self) -> None:
    """Blocks until every pending asynchronous save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
