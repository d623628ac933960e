"""Checkpoints of refusion_jax.

`save_model` / `load_model`: a self-describing model folder (our
`model_config.json` + an orbax checkpoint of the parameters). Writes go to a
temporary folder renamed into place, so a crash never leaves half a model.

`TrainCheckpointer`: the one checkpoint format of every trainer (the supervised
trainer, the D2F distillation, RL): an orbax CheckpointManager of the parameters
and optimizer state, a JSON meta (the step and what a resume must match) and,
for a trainer that reads a grain iterator, its position.
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
from jax.experimental import multihost_utils

from refusion_jax import sharding

# The model folder's config file and its readers live in config.py and are part of
# this module's interface too.
from refusion_jax.config import (  # noqa: F401  pylint: disable=unused-import
  MODEL_CONFIG_FILE,
  ModelConfig,
  is_model_dir,
  read_model_config,
)
from refusion_jax.model import Transformer, convert_layer_layout

PARAMS_DIR = "params"


def save_model(directory: str, config: ModelConfig, model: nnx.Module, overwrite: bool = False):
  """Writes `directory/model_config.json` and `directory/params` atomically.

  In a multi-process run every process must call this (orbax writes each
  process's shards of the parameters); process 0 alone writes the config and
  renames the folder into place, and no process returns before it is there.
  """
  directory = os.path.abspath(directory)
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(f"{directory} already exists (pass overwrite=True to replace it)")
  parent = os.path.dirname(directory)
  if jax.process_count() > 1:
    _save_model_multiprocess(directory, parent, config, model)
    return
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp_model_", dir=parent)
  try:
    _write_model(tmp, config, model)
    if os.path.exists(directory):
      shutil.rmtree(directory)
    os.replace(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _write_model(tmp: str, config: ModelConfig, model: nnx.Module, write_config: bool = True):
  if write_config:
    with open(os.path.join(tmp, MODEL_CONFIG_FILE), "w") as f:
      json.dump(dataclasses.asdict(config), f, indent=2)
  state = nnx.state(model, nnx.Param)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(tmp, PARAMS_DIR), state)
    ckptr.wait_until_finished()


def _save_model_multiprocess(directory: str, parent: str, config: ModelConfig,
                             model: nnx.Module) -> None:

  # Orbax assembles one checkpoint from every process's shards, so all processes
  # must name the same temporary folder: a per-process mkdtemp name would leave
  # each process waiting for the others' shards in a folder nobody writes.
  tmp = os.path.join(parent, f".tmp_model_{os.path.basename(directory)}")
  chief = jax.process_index() == 0
  try:
    if chief:
      os.makedirs(parent, exist_ok=True)
      shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
      os.makedirs(tmp)
    # Nobody writes shards before the folder exists and stale files are gone.
    multihost_utils.sync_global_devices(f"refusion_jax.save_model.begin:{directory}")
    _write_model(tmp, config, model, write_config=chief)
    # Every process's shards are committed before process 0 moves the folder.
    multihost_utils.sync_global_devices(f"refusion_jax.save_model.written:{directory}")
    if chief:
      if os.path.exists(directory):
        shutil.rmtree(directory)
      os.replace(tmp, directory)
    # A process may load the model right after this returns.
    multihost_utils.sync_global_devices(f"refusion_jax.save_model.done:{directory}")
  except BaseException:
    if chief:
      shutil.rmtree(tmp, ignore_errors=True)
    raise


def load_model(directory: str, mesh=None, rules: sharding.ShardingRules | None = None,
               scan_layers: bool | None = None):
  """Returns `(config, model)`, parameters placed on `mesh` when one is given.

  Without a mesh the parameters keep the shardings they were saved with, or,
  when those devices do not exist here (a multi-process run's folder), sit on
  the first local device. `scan_layers` (None: as saved) asks for a layer
  layout: a folder saved in the other one is restacked (or sliced) on load.
  """

  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"model folder {directory} does not exist")
  config = read_model_config(directory)
  if scan_layers is not None and scan_layers != config.scan_layers:
    # The folder's own layout first, then the parameters restacked (or sliced).

    saved_config, saved = load_model(directory, mesh=mesh, rules=rules)
    config = saved_config.replace(scan_layers=scan_layers)
    params = convert_layer_layout(nnx.to_pure_dict(nnx.state(saved, nnx.Param)),
                                  config.num_layers, scan_layers)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    if mesh is not None:
      state = jax.device_put(state, sharding.state_shardings(
          state, mesh, rules or sharding.ShardingRules()))
    return config, nnx.merge(graphdef, state)
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  if mesh is not None:
    shardings = sharding.state_shardings(abstract_state, mesh, rules or sharding.ShardingRules())
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state,
        shardings)
    fallback = None
  else:
    target = abstract_state
    # Arrays go back to the devices they were saved from; a folder written by a
    # multi-process run names devices this process lacks, and then lands on
    # one local device instead.
    fallback = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  # The plain Checkpointer: StandardCheckpointer.restore cannot pass a fallback sharding.
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
    state = ckptr.restore(os.path.join(directory, PARAMS_DIR),
                          args=ocp.args.StandardRestore(target, fallback_sharding=fallback))
  return config, nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------
# Training checkpoints: an orbax CheckpointManager over two or three items.
#
#   state  params + optimizer state (one pytree; restored straight into the
#          target shardings)
#   meta   JSON: step, seed and what the run must keep constant to resume
#   data   the grain iterator position, one JSON file per JAX process (only
#          trainers whose batches come from an iterator; the others draw
#          theirs from (seed, step) and have nothing to save)
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


# Files of a checkpoint step that orbax writes as JSON (besides `*.json`).
_JSON_FILES = ("_METADATA", "metadata", "_CHECKPOINT_METADATA")


class TrainCheckpointer:
  """Keeps the last `max_to_keep` training checkpoints under `directory`.

  `with_data=False`: the checkpoints hold no data item (the trainer's batches are a
  function of its seed and step); `save` and `restore` then take no iterator.
  """

  def __init__(self, directory: str, *, max_to_keep: int, async_save: bool = True,
               with_data: bool = True):
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f"checkpoint.max_to_keep must be a positive int, got {max_to_keep!r}")
    self.directory = os.path.abspath(directory)
    self.with_data = bool(with_data)
    self._items = (STATE_ITEM, META_ITEM) + ((DATA_ITEM,) if self.with_data else ())
    handlers = {STATE_ITEM: ocp.StandardCheckpointHandler(),
                META_ITEM: ocp.JsonCheckpointHandler()}
    if self.with_data:
      handlers[DATA_ITEM] = grain.checkpoint.CheckpointHandler()
    # cleanup_tmp_directories: a save cut short by a kill leaves a temporary folder
    # that is never a valid step; orbax removes it (in the background, finished
    # before the next save) when the next run opens the manager.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=bool(async_save),
        cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=handlers)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def damage(self, step: int) -> str | None:
    """What is visibly wrong with checkpoint `step` (a missing item or metadata file, a JSON
    file that does not parse), or None. A truncated array shows only when restored."""
    where = os.path.join(self.directory, str(int(step)))
    for item in self._items:
      if not os.path.isdir(os.path.join(where, item)):
        return f"its {item!r} folder is missing"
    if not os.path.isfile(os.path.join(where, STATE_ITEM, "_METADATA")):
      return f"{STATE_ITEM}/_METADATA (the array metadata) is missing"
    for item in self._items:
      folder = os.path.join(where, item)
      for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not (name.endswith(".json") or name in _JSON_FILES) or not os.path.isfile(path):
          continue
        try:
          with open(path, encoding="utf-8") as f:
            json.load(f)
        except (OSError, ValueError) as e:
          return f"{item}/{name} is not valid JSON ({e})"
    return None

  def move_aside(self, step: int) -> str:
    """Renames checkpoint `step` to `<step>.damaged` (or `.damaged.N`); returns the new path.

    The manager forgets the step, so a later save of the same step starts afresh.
    """
    where = os.path.join(self.directory, str(int(step)))
    target, n = where + ".damaged", 1
    while os.path.lexists(target):
      target, n = f"{where}.damaged.{n}", n + 1
    os.rename(where, target)
    self.reload()
    return target

  def reload(self) -> None:
    """Re-reads which steps exist (after another process moved one aside)."""
    self._manager.reload()

  def _check_iterator(self, data_iterator) -> None:
    if (data_iterator is not None) != self.with_data:
      raise ValueError(f"{self.directory}: checkpoints made with_data={self.with_data} take "
                       f"{'a' if self.with_data else 'no'} data iterator")

  def save(self, step: int, state, data_iterator, meta: dict) -> None:
    """Starts saving `state` (a pytree of arrays), `meta` and the iterator position."""
    self._check_iterator(data_iterator)
    items = {STATE_ITEM: ocp.args.StandardSave(state),
             META_ITEM: ocp.args.JsonSave(dict(meta, step=int(step)))}
    if self.with_data:
      items[DATA_ITEM] = grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iterator))
    # force: the trainer decides when to save; orbax's interval logic stays out.
    self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)

  def read_meta(self, step: int) -> dict:
    restored = self._manager.restore(
        int(step), args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
    return dict(restored[META_ITEM])

  def restore(self, step: int, abstract_state, data_iterator):
    """Returns `(state, meta)` and moves `data_iterator` (if any) to the saved position.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` whose `sharding`
    says where each restored array goes.
    """
    self._check_iterator(data_iterator)
    items = {STATE_ITEM: ocp.args.StandardRestore(abstract_state),
             META_ITEM: ocp.args.JsonRestore()}
    if self.with_data:
      items[DATA_ITEM] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(**items))
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
