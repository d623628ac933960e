"""Training: one jitted, donated train step and the loop around it.

  python -m refusion_jax.train --config=configs/tiny_refusion.py --workdir=W \
      [--config.field=value ...]

The loop, `train_and_evaluate(config, workdir)`:

* validates the config (and the model config and tokenizer it implies) before
  anything is compiled or loaded;
* builds the model on a (data, fsdp, tensor) mesh: a preset plus overrides,
  or a Hugging Face Qwen3 folder (`config.init_from_hf`) extended with
  ReFusion's two special tokens (see `add_special_token_rows`);
* resumes from the newest checkpoint in `W/checkpoints` when there is one:
  parameters, AdamW state, step and data position are restored and the step
  rng is `fold_in(fold_in(key(seed), 0), step)`, so a resumed run is
  bit-identical to an uninterrupted one;
* logs `W/metrics.jsonl` (one JSON object per logged step) and TensorBoard
  events in `W/tensorboard`, stops on a non-finite loss or gradient without
  saving the bad state, and finally writes `W/final_model` (our model
  folder) and, when `config.export_hf_dir` is set, a HF folder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging as std_logging
import math
import numbers
import os
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from refusion_jax import checkpoint, hf, objective, sharding
from refusion_jax import config as config_lib
from refusion_jax.config import ModelConfig
from refusion_jax.model import Qwen3
from refusion_jax.tokenizer import Tokenizer

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINT_DIR = "checkpoints"
FINAL_MODEL_DIR = "final_model"
BATCH_KEYS = ("tokens", "prompt_len", "response_len")
# ModelConfig fields that fix parameter shapes: an HF init defines them itself.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim", "tie_embeddings")
# Independent rng streams under one seed.
_TRAIN_STREAM, _EVAL_STREAM = 0, 1


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient; nothing of that step was saved."""


# ---------------------------------------------------------------------------
# Config validation (pure Python: runs before any device work).


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require(condition: bool, field: str, value, what: str) -> None:
  if not condition:
    raise ValueError(f"config.{field} must be {what}, got {value!r}")


def mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
  """Resolves config.mesh (one axis may be -1) against `num_devices` devices."""
  sizes = {}
  for axis in sharding.MESH_AXES:
    value = mesh_config[axis]
    _require(_is_int(value) and (value >= 1 or value == -1), f"mesh.{axis}", value,
             "a positive int or -1")
    sizes[axis] = int(value)
  free = [a for a, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise ValueError("config.mesh: at most one axis may be -1, got "
                     + ", ".join(f"mesh.{a}=-1" for a in free))
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(f"config.mesh: {num_devices} devices are not divisible by the fixed "
                       f"axes {sizes}")
    sizes[free[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"config.mesh {sizes} needs {math.prod(sizes.values())} devices, but "
                     f"{num_devices} are in use (config.mesh.num_devices="
                     f"{mesh_config.get('num_devices', 0)})")
  return sizes


def validate_config(config, *, num_devices: int, process_count: int = 1) -> dict[str, int]:
  """Checks every field the trainer reads; returns the resolved mesh shape.

  Raises ValueError naming the first bad field. Nothing is compiled, loaded or
  placed on a device here.
  """
  if config.objective not in objective.OBJECTIVES:
    raise ValueError(f"config.objective must be one of {objective.OBJECTIVES}, "
                     f"got {config.objective!r}")
  try:
    objective.check_slot_sizes(tuple(config.slot_sizes) if isinstance(
        config.slot_sizes, (list, tuple)) else config.slot_sizes)
  except ValueError as e:
    raise ValueError(f"config.slot_sizes: {e}") from None
  _require(_is_real(config.eps) and 0.0 < config.eps < 1.0, "eps", config.eps,
           "a float in (0, 1)")
  _require(_is_int(config.seed) and 0 <= config.seed < 2**31, "seed", config.seed,
           "an int in [0, 2**31)")
  _require(_is_int(config.global_batch_size) and config.global_batch_size >= 1,
           "global_batch_size", config.global_batch_size, "a positive int")
  _require(_is_int(config.num_train_steps), "num_train_steps", config.num_train_steps,
           "an int (<= 0: derive from num_epochs)")
  _require(_is_int(config.num_epochs) and config.num_epochs >= 0, "num_epochs",
           config.num_epochs, "a non-negative int")
  if config.num_train_steps <= 0 and config.num_epochs <= 0:
    raise ValueError(f"config.num_train_steps={config.num_train_steps} and config.num_epochs="
                     f"{config.num_epochs}: set one of them to a positive value")

  opt = config.optimizer
  _require(_is_real(opt.learning_rate) and opt.learning_rate > 0, "optimizer.learning_rate",
           opt.learning_rate, "a positive float")
  _require(_is_int(opt.warmup_steps) and opt.warmup_steps >= 0, "optimizer.warmup_steps",
           opt.warmup_steps, "a non-negative int")
  if config.num_train_steps > 0 and opt.warmup_steps > config.num_train_steps:
    raise ValueError(f"config.optimizer.warmup_steps={opt.warmup_steps} exceeds "
                     f"config.num_train_steps={config.num_train_steps}")
  _require(_is_real(opt.end_lr_ratio) and 0.0 <= opt.end_lr_ratio <= 1.0,
           "optimizer.end_lr_ratio", opt.end_lr_ratio, "a float in [0, 1]")
  _require(_is_real(opt.weight_decay) and opt.weight_decay >= 0, "optimizer.weight_decay",
           opt.weight_decay, "a non-negative float")
  for name in ("b1", "b2"):
    _require(_is_real(opt[name]) and 0.0 <= opt[name] < 1.0, f"optimizer.{name}", opt[name],
             "a float in [0, 1)")
  _require(_is_real(opt.eps) and opt.eps > 0, "optimizer.eps", opt.eps, "a positive float")
  _require(_is_real(opt.grad_clip_norm), "optimizer.grad_clip_norm", opt.grad_clip_norm,
           "a float (<= 0 disables clipping)")

  _require(_is_int(config.data.seq_len) and config.data.seq_len >= 2, "data.seq_len",
           config.data.seq_len, "an int >= 2")
  _require(len(config.data.train_files) > 0, "data.train_files", config.data.train_files,
           "a non-empty list of JSON/JSONL files")
  for field in ("train_files", "eval_files"):
    for path in config.data[field]:
      if not os.path.isfile(path):
        raise ValueError(f"config.data.{field}: {path!r} is not a file")
  _require(_is_int(config.eval_every_steps) and config.eval_every_steps >= 0,
           "eval_every_steps", config.eval_every_steps, "a non-negative int (0 = never)")
  if config.eval_every_steps > 0 and not config.data.eval_files:
    raise ValueError(f"config.eval_every_steps={config.eval_every_steps} needs "
                     "config.data.eval_files, which is empty")
  _require(_is_int(config.eval_batches) and config.eval_batches >= 0, "eval_batches",
           config.eval_batches, "a non-negative int (0 = all)")
  _require(_is_int(config.log_every_steps) and config.log_every_steps >= 1, "log_every_steps",
           config.log_every_steps, "a positive int")
  _require(_is_int(config.checkpoint.every_steps) and config.checkpoint.every_steps >= 1,
           "checkpoint.every_steps", config.checkpoint.every_steps, "a positive int")
  _require(_is_int(config.checkpoint.max_to_keep) and config.checkpoint.max_to_keep >= 1,
           "checkpoint.max_to_keep", config.checkpoint.max_to_keep, "a positive int")

  if "preset" not in config.model:
    raise ValueError("config.model.preset is missing")
  if not config.init_from_hf and config.model.preset not in config_lib.PRESETS:
    raise ValueError(f"config.model.preset must be one of {sorted(config_lib.PRESETS)}, "
                     f"got {config.model.preset!r}")
  if config.init_from_hf and not os.path.isdir(config.init_from_hf):
    raise ValueError(f"config.init_from_hf={config.init_from_hf!r} is not a directory")

  sizes = mesh_shape(config.mesh, num_devices)
  batch_shards = sizes["data"] * sizes["fsdp"]
  if config.global_batch_size % batch_shards:
    raise ValueError(
        f"config.global_batch_size={config.global_batch_size} is not divisible by the mesh's "
        f"data x fsdp = {sizes['data']} x {sizes['fsdp']} = {batch_shards} batch shards "
        "(config.mesh.data, config.mesh.fsdp)")
  if config.global_batch_size % process_count:
    raise ValueError(f"config.global_batch_size={config.global_batch_size} is not divisible "
                     f"by the {process_count} JAX processes")
  return sizes


def load_tokenizer(config) -> Tokenizer:
  """config.tokenizer_dir, else init_from_hf's folder, else the bundled tiny tokenizer."""
  directory = config.tokenizer_dir or config.init_from_hf
  return Tokenizer.from_dir(directory) if directory else Tokenizer.tiny()


def _model_overrides(config) -> dict[str, Any]:
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  # None means "the preset's value" (config files declare typed placeholders).
  overrides = {k: v for k, v in config.model.items() if k != "preset" and v is not None}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ValueError(f"config.model has unknown field(s) {unknown}; ModelConfig fields are "
                     f"{sorted(known)}")
  return overrides


def build_model_config(config, tokenizer: Tokenizer) -> ModelConfig:
  """The ModelConfig to train, from the preset or from init_from_hf's config.json.

  With `init_from_hf` the shapes come from the HF folder, the vocabulary is
  resized to `tokenizer.id_limit` (highest token id + 1; Qwen3-8B: 151936 ->
  151671 as in the release), the special-token ids are the tokenizer's, and
  config.model may set only non-shape fields (dtype, param_dtype, attention,
  max_position_embeddings, ...); a shape field there must agree with the folder.
  """
  overrides = _model_overrides(config)
  if not config.init_from_hf:
    try:
      return config_lib.get_preset(config.model.preset, **overrides)
    except (TypeError, ValueError) as e:
      raise ValueError(f"config.model: {e}") from None
  base = config_lib.from_hf_config(config.init_from_hf)
  for name in SHAPE_FIELDS:
    if name in overrides and name != "vocab_size" and overrides[name] != getattr(base, name):
      raise ValueError(
          f"config.model.{name}={overrides[name]!r} conflicts with init_from_hf "
          f"{config.init_from_hf!r}, whose config.json has {name}={getattr(base, name)!r}")
  overrides.pop("vocab_size", None)
  changes = dict(vocab_size=tokenizer.id_limit, mask_token_id=tokenizer.mask_id,
                 bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                 pad_token_id=tokenizer.pad_id)
  changes.update({k: v for k, v in overrides.items() if k not in SHAPE_FIELDS})
  try:
    return base.replace(**changes)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.model (on top of init_from_hf): {e}") from None


def validate_model_config(config, model_config: ModelConfig, tokenizer: Tokenizer) -> None:
  """Checks that the model, the tokenizer and the objective fit together."""
  if config.data.seq_len > model_config.max_position_embeddings:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} exceeds the model's "
                     f"max_position_embeddings={model_config.max_position_embeddings}")
  if config.objective in ("refusion", "mdm") and model_config.mask_token_id is None:
    raise ValueError(f"config.objective={config.objective!r} needs a mask token, but the model "
                     "config has mask_token_id=None (set config.model.mask_token_id)")
  want = "bidirectional" if config.objective == "mdm" else "causal"
  if model_config.attention != want:
    raise ValueError(f"config.objective={config.objective!r} needs config.model.attention="
                     f"{want!r}, got {model_config.attention!r}")
  try:
    tokenizer.check_compatible(model_config)
  except ValueError as e:
    raise ValueError(f"vocabulary mismatch between the tokenizer (config.tokenizer_dir) and "
                     f"the model (config.model / config.init_from_hf): {e}") from None
  if model_config.mask_token_id is not None and model_config.mask_token_id != tokenizer.mask_id:
    raise ValueError(f"config.model.mask_token_id={model_config.mask_token_id} but the "
                     f"tokenizer's <|mask|> id is {tokenizer.mask_id}")


def total_train_steps(config, num_records: int) -> int:
  """config.num_train_steps, or num_epochs * records // global batch.

  Over-long examples dropped by the loader are not subtracted (counting them
  needs a full tokenising pass), so an epoch-derived run may start the next
  epoch for a few steps.
  """
  if config.num_train_steps > 0:
    return int(config.num_train_steps)
  steps = config.num_epochs * num_records // config.global_batch_size
  if steps < 1:
    raise ValueError(f"config.num_epochs={config.num_epochs} over {num_records} examples at "
                     f"config.global_batch_size={config.global_batch_size} gives no step")
  if config.optimizer.warmup_steps > steps:
    raise ValueError(f"config.optimizer.warmup_steps={config.optimizer.warmup_steps} exceeds "
                     f"the {steps} steps of config.num_epochs={config.num_epochs}")
  return steps


# ---------------------------------------------------------------------------
# Optimizer, rngs, parameter surgery.


def make_optimizer(opt_config, total_steps: int):
  """AdamW with linear warmup (possibly none) + cosine decay and global-norm clipping.

  Returns `(tx, schedule)`; `schedule(step)` is the rate of update `step` (0-based).
  """
  peak = float(opt_config.learning_rate)
  end = peak * float(opt_config.end_lr_ratio)
  warmup = int(opt_config.warmup_steps)
  if warmup > 0:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=end)
  else:
    schedule = optax.cosine_decay_schedule(
        init_value=peak, decay_steps=max(total_steps, 1), alpha=float(opt_config.end_lr_ratio))
  adamw = optax.adamw(schedule, b1=float(opt_config.b1), b2=float(opt_config.b2),
                      eps=float(opt_config.eps), weight_decay=float(opt_config.weight_decay))
  if opt_config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(float(opt_config.grad_clip_norm)), adamw), \
        schedule
  return adamw, schedule


def step_rng(seed: int, step) -> jax.Array:
  """The rng of train step `step`: a function of (seed, step) only."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _TRAIN_STREAM), step)


def eval_rng(seed: int, index) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _EVAL_STREAM), index)


def _resize_rows(table_vd, vocab_size: int, reset_ids: tuple[int, ...]):
  """Rows of `table_vd` resized to `vocab_size`; new and reset rows get the mean row.

  The mean is taken over the rows that are kept and not reset, in float32.
  """
  old, _ = table_vd.shape
  keep = min(old, vocab_size)
  kept_vd = table_vd[:keep]
  reused_v = jnp.ones((keep,), bool)
  for token_id in reset_ids:
    if token_id < keep:
      reused_v = reused_v.at[token_id].set(False)
  weights_v = reused_v.astype(jnp.float32)
  mean_d = jnp.einsum("v,vd->d", weights_v, kept_vd.astype(jnp.float32)) / jnp.sum(weights_v)
  fresh_v = jnp.arange(vocab_size) >= keep
  for token_id in reset_ids:
    fresh_v = fresh_v.at[token_id].set(True)
  if vocab_size > keep:
    kept_vd = jnp.concatenate(
        [kept_vd, jnp.zeros((vocab_size - keep, kept_vd.shape[1]), kept_vd.dtype)])
  return jnp.where(fresh_v[:, None], mean_d.astype(table_vd.dtype), kept_vd)


def add_special_token_rows(params: dict, *, vocab_size: int, reset_ids: tuple[int, ...]) -> dict:
  """Resizes the embedding (and an untied lm_head) to `vocab_size` rows/columns.

  The rule (ReFusion's release adds `<|beginoftext|>` and `<|mask|>` this way):
  rows `[0, min(old, vocab_size))` are kept; every appended row and every row
  listed in `reset_ids` (the two special tokens) is set to the mean of the
  kept rows that are not reset. The untied head's columns follow the same
  rule. For Qwen3-8B (151936 rows, tokenizer ids up to 151670) the mean is
  over ids 0..151668, i.e. every token the backbone was trained with.
  """
  params = dict(params)
  reset_ids = tuple(int(i) for i in reset_ids)
  params["embed"] = _resize_rows(params["embed"], vocab_size, reset_ids)
  if "lm_head" in params:
    params["lm_head"] = _resize_rows(params["lm_head"].T, vocab_size, reset_ids).T
  return params


# ---------------------------------------------------------------------------
# The compiled pieces.


class Trainer:
  """Shardings, optimizer and the jitted train / eval steps for one model on one mesh."""

  def __init__(self, config, model_config: ModelConfig, *, mesh, pad_id: int, total_steps: int,
               rules: sharding.ShardingRules | None = None):
    self.config = config
    self.model_config = model_config
    self.mesh = mesh
    self.rules = rules or sharding.ShardingRules()
    self.seed = int(config.seed)
    self.total_steps = int(total_steps)
    self.loss_kwargs = dict(
        objective=config.objective,
        mask_id=model_config.mask_token_id if model_config.mask_token_id is not None else 0,
        pad_id=int(pad_id), slot_sizes=tuple(config.slot_sizes), eps=float(config.eps))

    abstract_model = nnx.eval_shape(lambda: Qwen3(model_config, rngs=nnx.Rngs(0)))
    self.graphdef, abstract_state = nnx.split(abstract_model)
    self.param_shardings = nnx.to_pure_dict(
        sharding.state_shardings(abstract_state, mesh, self.rules))
    self.abstract_params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract_state), self.param_shardings)
    self.replicated = NamedSharding(mesh, PartitionSpec())

    self.tx, self.schedule = make_optimizer(config.optimizer, self.total_steps)
    abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
    self.opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract_opt, self.param_shardings,
        transform_non_params=lambda _: self.replicated)
    self.abstract_opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_opt,
        self.opt_shardings)
    self.batch_shardings = {
        "tokens": sharding.data_sharding(mesh, self.rules, 2),
        "prompt_len": sharding.data_sharding(mesh, self.rules, 1),
        "response_len": sharding.data_sharding(mesh, self.rules, 1),
    }
    self._train_step = jax.jit(
        self._step,
        in_shardings=(self.param_shardings, self.opt_shardings, self.batch_shardings,
                      self.replicated),
        out_shardings=(self.param_shardings, self.opt_shardings, self.replicated),
        donate_argnums=(0, 1))
    self._eval_step = jax.jit(
        self._eval, in_shardings=(self.param_shardings, self.batch_shardings, self.replicated),
        out_shardings=self.replicated)

  # -- pure functions that get compiled

  def _loss(self, params, batch, rng):
    model = nnx.merge(self.graphdef, params)
    return objective.loss_fn(model, batch, rng, **self.loss_kwargs)

  def _step(self, params, opt_state, batch, step):
    rng = step_rng(self.seed, step)
    (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, batch, rng)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, lr=self.schedule(step))
    return params, opt_state, metrics

  def _eval(self, params, batch, index):
    loss, metrics = self._loss(params, batch, eval_rng(self.seed, index))
    return dict(metrics, loss=loss)

  # -- host-side entry points

  def abstract_train_state(self) -> dict:
    return {"params": self.abstract_params, "opt_state": self.abstract_opt_state}

  def init_params(self) -> dict:
    """Random initialisation, computed directly in the target shardings."""

    def init():
      model = Qwen3(self.model_config, rngs=nnx.Rngs(self.seed))
      return nnx.to_pure_dict(nnx.split(model)[1])

    return jax.jit(init, out_shardings=self.param_shardings)()

  def place_params(self, params) -> dict:
    """Copies a parameter dict (host or device arrays) into the target shardings."""
    # may_alias=False: the train step donates these buffers, which must never be
    # the caller's own (host) memory.
    dtype = self.model_config.weight_dtype
    return jax.tree.map(
        lambda x, s: jax.device_put(np.asarray(jax.device_get(x)).astype(dtype), s,
                                    may_alias=False),
        params, self.param_shardings)

  def init_opt_state(self, params) -> Any:
    return jax.jit(self.tx.init, in_shardings=(self.param_shardings,),
                   out_shardings=self.opt_shardings)(params)

  def shard_batch(self, batch: Mapping[str, np.ndarray]) -> dict:
    """This process's rows -> global arrays sharded over the batch mesh axes."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
      raise ValueError(f"batch is missing {missing}")
    return {k: jax.make_array_from_process_local_data(
        self.batch_shardings[k], np.asarray(batch[k], np.int32)) for k in BATCH_KEYS}

  def train_step(self, params, opt_state, batch, step: int):
    """One update; `params` and `opt_state` are donated (do not reuse them)."""
    with sharding.use_mesh(self.mesh, self.rules):
      return self._train_step(params, opt_state, batch, jnp.asarray(step, jnp.int32))

  def eval_step(self, params, batch, index: int):
    with sharding.use_mesh(self.mesh, self.rules):
      return self._eval_step(params, batch, jnp.asarray(index, jnp.int32))

  def model(self, params) -> nnx.Module:
    return nnx.merge(self.graphdef, params)


def init_params_from_hf(trainer: Trainer, directory: str, tokenizer: Tokenizer) -> dict:
  """Loads a HF Qwen3 folder and adds the special tokens' rows (`add_special_token_rows`).

  A folder that is already a ReFusion checkpoint (its config.json names the
  tokenizer's mask id) keeps its trained special rows; only a vocabulary
  resize, if any, applies.
  """
  model_config = trainer.model_config
  hf_config, hf_model = hf.load(directory, mesh=trainer.mesh, rules=trainer.rules,
                                dtype=model_config.param_dtype)
  if hf_config.tie_embeddings != model_config.tie_embeddings:
    raise ValueError(f"init_from_hf {directory!r}: tie_embeddings={hf_config.tie_embeddings} "
                     f"but the model config says {model_config.tie_embeddings}")
  params = nnx.to_pure_dict(nnx.split(hf_model)[1])
  already = hf_config.mask_token_id == tokenizer.mask_id
  reset = () if already else tuple(i for i in (tokenizer.bos_id, tokenizer.mask_id)
                                     if i is not None)
  logging.info("init_from_hf: %s, vocab %d -> %d, special rows reset to the mean: %s",
               directory, hf_config.vocab_size, model_config.vocab_size, reset)
  resize = functools.partial(add_special_token_rows, vocab_size=model_config.vocab_size,
                             reset_ids=reset)
  return jax.jit(resize, out_shardings=trainer.param_shardings)(params)


# ---------------------------------------------------------------------------
# Logging.


class MetricsLog:
  """`W/metrics.jsonl` plus TensorBoard scalars; only process 0 writes."""

  def __init__(self, workdir: str, resume_step: int, enabled: bool):
    self.enabled = enabled
    self.path = os.path.join(workdir, METRICS_FILE)
    self._file = None
    self._tb = None
    if not enabled:
      return
    self._truncate_after(resume_step)
    self._file = open(self.path, "a")
    from tensorboardX import SummaryWriter  # heavy-ish; only the writing process needs it
    self._tb = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))

  def _truncate_after(self, step: int) -> None:
    # Lines logged after the checkpoint we resume from (and a line cut by a
    # kill) are dropped: the resumed run logs those steps again.
    if not os.path.exists(self.path):
      return
    kept = []
    with open(self.path) as f:
      for line in f:
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue
        if isinstance(record, dict) and record.get("step", math.inf) <= step:
          kept.append(json.dumps(record) + "\n")
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)

  def write(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
    if not self.enabled:
      return
    record = {"step": int(step)}
    record.update({prefix + k: float(v) for k, v in metrics.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in metrics.items():
      self._tb.add_scalar(prefix + k, float(v), int(step))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


# ---------------------------------------------------------------------------
# The loop.


@dataclasses.dataclass
class TrainResult:
  step: int  # steps completed
  model_config: ModelConfig
  params: dict  # final parameters (pure dict of arrays)
  last_metrics: dict  # host metrics of the last step run in this call ({} if none)
  eval_metrics: dict  # last eval ({} if none)


def _resume_meta(config, model_config: ModelConfig, total_steps: int) -> dict:
  return {"seed": int(config.seed), "objective": config.objective,
          "global_batch_size": int(config.global_batch_size),
          "seq_len": int(config.data.seq_len), "total_steps": int(total_steps),
          "model_config": dataclasses.asdict(model_config)}


def _check_resume(saved: Mapping[str, Any], wanted: Mapping[str, Any], where: str) -> None:
  # A run resumed with another seed, batch, shape or schedule would not be the same run.
  for key, value in wanted.items():
    if key in saved and saved[key] != value:
      raise ValueError(f"{where} was written with {key}={saved[key]!r} but the config now "
                       f"gives {value!r}; use a new workdir or restore the old setting")


def _devices(config) -> list:
  n = config.mesh.num_devices
  _require(_is_int(n) and n >= 0, "mesh.num_devices", n, "a non-negative int")
  devices = jax.devices()
  if n == 0:
    return devices
  if jax.process_count() > 1:
    raise ValueError("config.mesh.num_devices > 0 is for single-process runs only")
  if n > len(devices):
    raise ValueError(f"config.mesh.num_devices={n} but only {len(devices)} devices exist")
  return devices[:n]


def _evaluate(trainer: Trainer, params, data_config, tokenizer) -> dict:
  from refusion_jax import data  # local: the TFDS import is slow and eval is optional

  config = trainer.config
  loader = data.loader_from_config(data_config, tokenizer, config.global_batch_size, "eval",
                                   jax.process_index(), jax.process_count())
  totals: dict[str, float] = {}
  count = 0
  batches = iter(loader)
  while True:
    batch = next(batches, None)
    # The eval split keeps a short last batch; its shape would not shard evenly.
    full = batch is not None and len(batch["tokens"]) == loader.per_process_batch
    if jax.process_count() > 1:
      # Each process drops its own shard's over-long rows, so the processes may
      # hold different numbers of full batches; eval_step is a collective that
      # every process must run, so all stop at the first batch one lacks.
      from jax.experimental import multihost_utils  # only multi-process runs need it
      full = bool(np.all(multihost_utils.process_allgather(np.asarray([full]))))
    if not full:
      break
    metrics = jax.device_get(trainer.eval_step(params, trainer.shard_batch(batch), count))
    for k, v in metrics.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    count += 1
    if config.eval_batches and count >= config.eval_batches:
      break
  if count == 0:
    raise ValueError(f"config.data.eval_files hold no full batch of "
                     f"{config.global_batch_size} rows")
  return {k: v / count for k, v in totals.items()}


def train_and_evaluate(config, workdir: str) -> TrainResult:
  """Trains (resuming from `workdir` when it holds checkpoints); see the module doc."""
  from refusion_jax import data  # local: the TFDS import is slow and validation comes first

  workdir = os.path.abspath(workdir)
  devices = _devices(config)
  sizes = validate_config(config, num_devices=len(devices), process_count=jax.process_count())
  tokenizer = load_tokenizer(config)
  model_config = build_model_config(config, tokenizer)
  validate_model_config(config, model_config, tokenizer)

  os.makedirs(workdir, exist_ok=True)
  data_config = config.data.to_dict()
  data_config["train_files"] = list(data_config["train_files"])
  data_config["eval_files"] = list(data_config["eval_files"])
  data_config["tfds_dir"] = data_config["tfds_dir"] or os.path.join(workdir, "tfds")
  loader = data.loader_from_config(data_config, tokenizer, config.global_batch_size, "train",
                                   jax.process_index(), jax.process_count())
  total_steps = total_train_steps(config, loader.num_records)
  mesh = sharding.make_mesh(devices=devices, **sizes)
  trainer = Trainer(config, model_config, mesh=mesh, pad_id=tokenizer.pad_id,
                    total_steps=total_steps)
  meta = _resume_meta(config, model_config, total_steps)
  is_chief = jax.process_index() == 0

  ckpt = checkpoint.TrainCheckpointer(os.path.join(workdir, CHECKPOINT_DIR),
                                      max_to_keep=config.checkpoint.max_to_keep,
                                      async_save=config.checkpoint.async_save)
  log = None
  try:
    data_iter = iter(loader)
    start = ckpt.latest_step()
    if start is not None:
      where = os.path.join(ckpt.directory, str(start))
      _check_resume(ckpt.read_meta(start), meta, where)
      state, _ = ckpt.restore(start, trainer.abstract_train_state(), data_iter)
      params, opt_state = state["params"], state["opt_state"]
      logging.info("resumed from %s", where)
    else:
      start = 0
      if config.init_from_hf:
        params = init_params_from_hf(trainer, config.init_from_hf, tokenizer)
      else:
        params = trainer.init_params()
      opt_state = trainer.init_opt_state(params)

    log = MetricsLog(workdir, start, enabled=is_chief)
    tokens_per_step = config.global_batch_size * config.data.seq_len
    last_metrics, eval_metrics = {}, {}
    progress = None
    if config.progress_bar and is_chief:
      import tqdm  # local: only the bar needs it
      progress = tqdm.tqdm(total=total_steps, initial=start, desc="train", unit="step")
    tick = time.perf_counter()
    for step in range(start, total_steps):
      batch = trainer.shard_batch(next(data_iter))
      params, opt_state, metrics = trainer.train_step(params, opt_state, batch, step)
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      done = step + 1
      if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
        ckpt.wait()  # pending saves of good states complete; this state is never saved
        what = "loss" if not math.isfinite(metrics["loss"]) else "gradient"
        raise NonFiniteLossError(
            f"non-finite training {what} at step {done} (update {step} -> {done}): loss="
            f"{metrics['loss']}, grad_norm={metrics['grad_norm']}; training stopped, the "
            f"last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")
      now = time.perf_counter()
      metrics["tokens_per_sec"] = tokens_per_step / max(now - tick, 1e-9)
      tick = now
      last_metrics = metrics
      if done % config.log_every_steps == 0 or done == total_steps:
        log.write(done, metrics)
      if progress is not None:
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
      if done % config.checkpoint.every_steps == 0 or done == total_steps:
        ckpt.save(done, {"params": params, "opt_state": opt_state}, data_iter, meta)
      if config.eval_every_steps and (done % config.eval_every_steps == 0
                                      or done == total_steps):
        eval_metrics = _evaluate(trainer, params, data_config, tokenizer)
        log.write(done, eval_metrics, prefix="eval_")
        logging.info("step %d eval %s", done, eval_metrics)
        tick = time.perf_counter()  # eval time is not training throughput
    if progress is not None:
      progress.close()
    ckpt.wait()

    model = trainer.model(params)
    checkpoint.save_model(os.path.join(workdir, FINAL_MODEL_DIR), model_config, model,
                          overwrite=True)
    if config.export_hf_dir:
      hf.save(model_config, model, config.export_hf_dir, overwrite=True)
    return TrainResult(step=max(start, total_steps), model_config=model_config, params=params,
                       last_metrics=last_metrics, eval_metrics=eval_metrics)
  finally:
    ckpt.close()
    if log is not None:
      log.close()


# ---------------------------------------------------------------------------
# Entry point (kept thin: everything above is importable and testable).


def define_flags():
  """--config and --workdir; defined only when run as a program, so this module can be
  imported beside the other entry points (sample, reproduce) without clashing flags."""
  config = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                           lock_config=True)
  workdir = flags.DEFINE_string("workdir", None, "Checkpoints, logs and the final model go here.")
  flags.mark_flags_as_required(["config", "workdir"])
  return config, workdir


class _QuietOrbax(std_logging.Filter):
  """Drops orbax's per-save INFO chatter (it buries the progress bar); keeps warnings."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def initialize_distributed() -> None:
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


def main(argv, config_flag, workdir_flag):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if config_flag.value.get("distributed", False):
    initialize_distributed()
  logging.get_absl_handler().addFilter(_QuietOrbax())
  try:
    train_and_evaluate(config_flag.value, workdir_flag.value)
  except NonFiniteLossError as e:
    # Not a bug in the code: say what happened and exit non-zero, without a traceback.
    logging.error("%s", e)
    raise SystemExit(f"refusion_jax.train: {e}") from None


if __name__ == "__main__":
  _config_flag, _workdir_flag = define_flags()
  app.run(lambda argv: main(argv, _config_flag, _workdir_flag))
