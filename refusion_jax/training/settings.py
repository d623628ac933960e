"""Training config checks, and what a valid config resolves to.

Pure Python apart from listing the devices: every check runs before anything
is compiled, loaded or placed on a device, and each failure names the field
and the value. `resolve(config)` runs them all, in order; the trainer and the
tests call it, so the list of checks lives here only.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax

from refusion_jax import attention_kernels, loading, objective, runtime, sharding
from refusion_jax import config as config_lib
from refusion_jax.checks import is_int, is_real, require
from refusion_jax.config import ModelConfig
from refusion_jax.tokenizer import Tokenizer

# Samples read to measure how many share a row, for a step count derived from epochs.
SAMPLES_MEASURED = 4096

# ModelConfig fields that fix parameter shapes: an HF init defines them itself.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim", "tie_embeddings", "model_type")


@dataclasses.dataclass(frozen=True)
class Resolved:
  """What a valid training config resolves to, before any device work."""

  devices: list  # the devices the mesh spans
  mesh_shape: dict[str, int]  # {"data", "fsdp", "tensor"} sizes over `devices`
  tokenizer: Tokenizer
  model_config: ModelConfig


def resolve(config) -> Resolved:
  """Every check of a training config, in order; raises ValueError naming the field."""
  devices = select_devices(config)
  sizes = validate_config(config, num_devices=len(devices), process_count=jax.process_count())
  tokenizer = load_tokenizer(config)
  model_config = build_model_config(config, tokenizer)
  validate_model_config(config, model_config, tokenizer)
  validate_attention_impl(config, model_config, devices[0].platform)
  return Resolved(devices=devices, mesh_shape=sizes, tokenizer=tokenizer,
                  model_config=model_config)


def select_devices(config) -> list:
  """config.mesh.num_devices: 0 = every device, n > 0 = the first n (one process only)."""
  n = config.mesh.num_devices
  require(is_int(n) and n >= 0, "mesh.num_devices", n, "a non-negative int")
  devices = jax.devices()
  if n == 0:
    return devices
  if jax.process_count() > 1:
    raise ValueError("config.mesh.num_devices > 0 is for single-process runs only")
  if n > len(devices):
    raise ValueError(f"config.mesh.num_devices={n} but only {len(devices)} devices exist")
  return devices[:n]


def mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
  """Resolves config.mesh (one axis may be -1) against `num_devices` devices."""
  sizes = {}
  for axis in sharding.MESH_AXES:
    value = mesh_config[axis]
    require(is_int(value) and (value >= 1 or value == -1), f"mesh.{axis}", value,
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


def validate_config(config, *, num_devices: int, process_count: int = 1,
                    check_files: bool = True) -> dict[str, int]:
  """Checks every field the trainer reads; returns the resolved mesh shape.

  Raises ValueError naming the first bad field. Nothing is compiled, loaded or
  placed on a device here. `check_files=False` skips whether the data files and
  the init_from_hf folder exist (a program compiled ahead of time reads neither).
  """
  if config.objective not in objective.OBJECTIVES:
    raise ValueError(f"config.objective must be one of {objective.OBJECTIVES}, "
                     f"got {config.objective!r}")
  try:
    objective.check_slot_sizes(tuple(config.slot_sizes) if isinstance(
        config.slot_sizes, (list, tuple)) else config.slot_sizes)
  except ValueError as e:
    raise ValueError(f"config.slot_sizes: {e}") from None
  require(is_real(config.eps) and 0.0 < config.eps < 1.0, "eps", config.eps,
          "a float in (0, 1)")
  boundary_label = config.get("boundary_label", False)
  require(isinstance(boundary_label, bool), "boundary_label", boundary_label, "a bool")
  if boundary_label and config.objective != "refusion":
    raise ValueError(f"config.boundary_label=True labels ReFusion's clean slots; "
                     f"config.objective={config.objective!r} has none")
  require(is_int(config.loss_chunk) and config.loss_chunk >= 0, "loss_chunk", config.loss_chunk,
          "a non-negative int (0 = full logits)")
  require(is_int(config.seed) and 0 <= config.seed < 2**31, "seed", config.seed,
          "an int in [0, 2**31)")
  require(is_int(config.global_batch_size) and config.global_batch_size >= 1,
          "global_batch_size", config.global_batch_size, "a positive int")
  require(is_int(config.num_train_steps), "num_train_steps", config.num_train_steps,
          "an int (<= 0: derive from num_epochs)")
  require(is_int(config.num_epochs) and config.num_epochs >= 0, "num_epochs",
          config.num_epochs, "a non-negative int")
  if config.num_train_steps <= 0 and config.num_epochs <= 0:
    raise ValueError(f"config.num_train_steps={config.num_train_steps} and config.num_epochs="
                     f"{config.num_epochs}: set one of them to a positive value")

  opt = config.optimizer
  require(is_real(opt.learning_rate) and opt.learning_rate > 0, "optimizer.learning_rate",
          opt.learning_rate, "a positive float")
  require(is_int(opt.warmup_steps) and opt.warmup_steps >= 0, "optimizer.warmup_steps",
          opt.warmup_steps, "a non-negative int")
  if config.num_train_steps > 0 and opt.warmup_steps > config.num_train_steps:
    raise ValueError(f"config.optimizer.warmup_steps={opt.warmup_steps} exceeds "
                     f"config.num_train_steps={config.num_train_steps}")
  require(is_real(opt.end_lr_ratio) and 0.0 <= opt.end_lr_ratio <= 1.0,
          "optimizer.end_lr_ratio", opt.end_lr_ratio, "a float in [0, 1]")
  require(is_real(opt.weight_decay) and opt.weight_decay >= 0, "optimizer.weight_decay",
          opt.weight_decay, "a non-negative float")
  for name in ("b1", "b2"):
    require(is_real(opt[name]) and 0.0 <= opt[name] < 1.0, f"optimizer.{name}", opt[name],
            "a float in [0, 1)")
  require(is_real(opt.eps) and opt.eps > 0, "optimizer.eps", opt.eps, "a positive float")
  require(is_real(opt.grad_clip_norm), "optimizer.grad_clip_norm", opt.grad_clip_norm,
          "a float (<= 0 disables clipping)")

  require(is_int(config.data.seq_len) and config.data.seq_len >= 2, "data.seq_len",
          config.data.seq_len, "an int >= 2")
  packing_mode = packing(config)
  require(packing_mode in objective.PACKINGS, "data.packing", packing_mode,
          f"one of {objective.PACKINGS}")
  bins = config.data.get("packing_bins", 0)
  require(is_int(bins) and bins >= 0, "data.packing_bins", bins,
          "an int >= 0 (0 = the default: at least a batch)")
  try:
    objective.check_bd3lm(*bd3lm_settings(config))
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
  mdm_len = config.get("mdm_response_len", 0)
  require(is_int(mdm_len) and mdm_len >= 0, "mdm_response_len", mdm_len,
          "an int >= 0 (0 = to the end of the row)")
  require(len(config.data.train_files) > 0, "data.train_files", config.data.train_files,
          "a non-empty list of JSON/JSONL files")
  for field in ("train_files", "eval_files") if check_files else ():
    for path in config.data[field]:
      if not os.path.isfile(path):
        raise ValueError(f"config.data.{field}: {path!r} is not a file")
  require(is_int(config.eval_every_steps) and config.eval_every_steps >= 0,
          "eval_every_steps", config.eval_every_steps, "a non-negative int (0 = never)")
  if config.eval_every_steps > 0 and not config.data.eval_files:
    raise ValueError(f"config.eval_every_steps={config.eval_every_steps} needs "
                     "config.data.eval_files, which is empty")
  require(is_int(config.eval_batches) and config.eval_batches >= 0, "eval_batches",
          config.eval_batches, "a non-negative int (0 = all)")
  require(is_int(config.log_every_steps) and config.log_every_steps >= 1, "log_every_steps",
          config.log_every_steps, "a positive int")
  require(is_int(config.checkpoint.every_steps) and config.checkpoint.every_steps >= 1,
          "checkpoint.every_steps", config.checkpoint.every_steps, "a positive int")
  require(is_int(config.checkpoint.max_to_keep) and config.checkpoint.max_to_keep >= 1,
          "checkpoint.max_to_keep", config.checkpoint.max_to_keep, "a positive int")

  if "preset" not in config.model:
    raise ValueError("config.model.preset is missing")
  if not config.init_from_hf and config.model.preset not in config_lib.PRESETS:
    raise ValueError(f"config.model.preset must be one of {sorted(config_lib.PRESETS)}, "
                     f"got {config.model.preset!r}")
  if check_files and config.init_from_hf:
    try:  # a shipped model's name, or a folder: the rule of every entry point
      loading.model_dir(config.init_from_hf, "--config.init_from_hf")
    except FileNotFoundError as e:
      raise ValueError(str(e)) from None

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
  """From init_from_hf: `loading`'s rule for that model (config.tokenizer_dir, else the
  folder's tokenizer.json, else the bundled tiny tokenizer when the model is shaped for
  it). From scratch: config.tokenizer_dir, else the bundled tiny tokenizer. Not checked
  against the folder's vocabulary: training resizes it to the tokenizer's."""
  if not config.init_from_hf:
    return Tokenizer.from_dir(config.tokenizer_dir) if config.tokenizer_dir else Tokenizer.tiny()
  folder = loading.resolve(config.init_from_hf)
  tokenizer = loading.find_tokenizer(folder, config_lib.from_hf_config(folder),
                                     config.tokenizer_dir)
  if tokenizer is None:
    raise ValueError(f"config.init_from_hf={config.init_from_hf!r}: no tokenizer (the folder "
                     f"has no {loading.TOKENIZER_FILE} and the model's vocabulary and special "
                     "ids are not the bundled tiny tokenizer's); set config.tokenizer_dir")
  return tokenizer


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
  # config.json alone (no weights): `aot` sizes a run from it.
  base = config_lib.from_hf_config(loading.resolve(config.init_from_hf))
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


def check_objective_fits(config, model_config: ModelConfig) -> None:
  """The objective's needs of the model: a mask token, and its attention kind."""
  if config.objective in ("refusion", "mdm", "bd3lm") and model_config.mask_token_id is None:
    raise ValueError(f"config.objective={config.objective!r} needs a mask token, but the model "
                     "config has mask_token_id=None (set config.model.mask_token_id)")
  if model_config.shift_logits:
    raise ValueError(f"config.objective={config.objective!r}: the model is a Dream model "
                     f"(model_type {model_config.model_type!r}, logits shifted by one), and "
                     "training one is not supported here (it decodes as an MDM)")
  want = objective.attention_for(config.objective)
  if model_config.attention != want:
    raise ValueError(f"config.objective={config.objective!r} needs config.model.attention="
                     f"{want!r}, got {model_config.attention!r}")


def validate_model_config(config, model_config: ModelConfig, tokenizer: Tokenizer) -> None:
  """Checks that the model, the tokenizer and the objective fit together."""
  if config.data.seq_len > model_config.max_position_embeddings:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} exceeds the model's "
                     f"max_position_embeddings={model_config.max_position_embeddings}")
  check_objective_fits(config, model_config)
  try:
    tokenizer.check_compatible(model_config)
  except ValueError as e:
    raise ValueError(f"vocabulary mismatch between the tokenizer (config.tokenizer_dir) and "
                     f"the model (config.model / config.init_from_hf): {e}") from None
  if model_config.mask_token_id is not None and model_config.mask_token_id != tokenizer.mask_id:
    raise ValueError(f"config.model.mask_token_id={model_config.mask_token_id} but the "
                     f"tokenizer's <|mask|> id is {tokenizer.mask_id}")


def validate_attention_impl(config, model_config: ModelConfig, platform: str) -> None:
  """config.model.attention_impl can run the training forward: rows of data.seq_len
  tokens, the model's compute dtype, on `platform` ("tpu", "gpu" or "cpu")."""
  if config.objective == "bd3lm" and model_config.attention_impl != "xla":
    raise ValueError(f"config.objective='bd3lm' needs config.model.attention_impl='xla', got "
                     f"{model_config.attention_impl!r}: its two-half mask depends on each "
                     "sample's prompt length, and the kernels here take only static masks and "
                     "segment ids")
  if model_config.attention_impl == "cudnn" and packing(config) != "none":
    raise ValueError(f"config.model.attention_impl='cudnn' cannot keep packed samples apart "
                     f"(cuDNN's attention here takes no segment ids), but config.data.packing="
                     f"{packing(config)!r}; use data.packing='none' or attention_impl='xla'")
  try:
    attention_kernels.check_supported(model_config.attention_impl, seq_len=config.data.seq_len,
                                      dtype=model_config.dtype, platform=platform,
                                      field="config.model.attention_impl")
  except ValueError as e:
    raise ValueError(f"{e} (config.data.seq_len={config.data.seq_len})") from None
  if model_config.attention_impl == "splash" and platform != "tpu":
    runtime.note("train", "config.model.attention_impl='splash' on %s devices runs the TPU kernel in "
                    "Pallas interpret mode: exact but slow (meant for checking numerics)",
                    platform)


def packing(config) -> str:
  """config.data.packing ("none" when a config predates the field)."""
  return config.data.get("packing", "none")


def eos_pad_response_to(config) -> int | None:
  """The loader's EOS padding of responses: the MDM baseline's `mdm_response_len`."""
  return int(config.get("mdm_response_len", 0)) if config.objective == "mdm" else None


def eos_pad_multiple(config) -> int:
  """The loader's EOS padding of responses to whole blocks: BD3-LM's block size (else 0)."""
  return int(bd3lm_settings(config)[0]) if config.objective == "bd3lm" else 0


def bd3lm_settings(config) -> tuple:
  """(bd3lm_block_size, bd3lm_eps_min, bd3lm_eps_max), the defaults when a config
  predates the fields."""
  return (config.get("bd3lm_block_size", objective.DEFAULT_BD3LM_BLOCK_SIZE),
          config.get("bd3lm_eps_min", objective.DEFAULT_BD3LM_EPS[0]),
          config.get("bd3lm_eps_max", objective.DEFAULT_BD3LM_EPS[1]))


def total_train_steps(config, num_records: int, samples_per_row: float = 1.0) -> int:
  """config.num_train_steps, or num_epochs * records // samples per step.

  A step holds global_batch_size rows of `samples_per_row` samples each (1
  without packing; packed, it is measured on the data by the trainer). Over-long
  examples dropped by the loader are not subtracted (counting them needs a full
  tokenising pass), so an epoch-derived run may start the next epoch for a few
  steps.
  """
  if config.num_train_steps > 0:
    return int(config.num_train_steps)
  steps = int(config.num_epochs * num_records // (config.global_batch_size * samples_per_row))
  if steps < 1:
    raise ValueError(f"config.num_epochs={config.num_epochs} over {num_records} examples at "
                     f"config.global_batch_size={config.global_batch_size} gives no step")
  if config.optimizer.warmup_steps > steps:
    raise ValueError(f"config.optimizer.warmup_steps={config.optimizer.warmup_steps} exceeds "
                     f"the {steps} steps of config.num_epochs={config.num_epochs}")
  return steps

