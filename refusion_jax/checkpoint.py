"""Checkpoints of refusion_jax.

`save_model` / `load_model`: a self-describing model folder (our
`model_config.json` + an orbax checkpoint of the parameters). Writes go to a
temporary folder renamed into place, so a crash never leaves half a model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

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
