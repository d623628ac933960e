"""LoRA adapters of the attention projections: PEFT folders in and out, merged or live.

D2F (ALGORITHM.md "Table 1's baselines") adapts an MDM's attention projections with
LoRA (rank 32, alpha 32: q, k, v and the output projection) so that it works under
block-causal attention. This module:

* reads a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`,
  tensors `base_model.model.<HF module>.lora_A.weight` `[r, in]` and `.lora_B.weight`
  `[out, r]`) against a model's config, each problem one line (`read_adapter`);
* merges it into the weights, `W + (alpha / r) B A` in float32 (`merge`): what decoding
  uses (no cost per pass);
* runs it live through `qwix` (Google's LoRA and quantisation library for Flax NNX):
  `apply` wraps a model's attention einsums with LoRA parameters (`nnx.LoRAParam`),
  `load_into` fills them from an adapter, `extract` reads them back and `save_adapter`
  writes a PEFT folder, so a trained adapter is all that is saved.

qwix's parameters for an einsum `btd,dnh->btnh` are A `[d, r]` and B `[r, n, h]` (for
the output projection `btnh,nhd->btd`: A `[n, h, r]`, B `[r, d]`); PEFT's are the
Linear layer's transposes with the heads flattened. Scanned layers are not supported
(qwix intercepts einsums per module; a scanned model runs one stacked module).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from refusion_jax import fileio, hf
from refusion_jax.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# Our attention projections and each family's module names for them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MODULE_NAMES = {"hf": {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
                        "o_proj": "o_proj"},
                 "llada": {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
                           "o_proj": "attn_out"}}
# adapter_config.json keys whose non-default values change what an adapter computes.
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
                "bias": "none", "modules_to_save": None, "layers_to_transform": None,
                "rank_pattern": {}, "alpha_pattern": {}}


@dataclasses.dataclass
class Adapter:
  """A LoRA adapter: rank, alpha and per (layer, projection) PEFT's `(A [r, in],
  B [out, r])` as float32 arrays."""

  rank: int
  alpha: float
  tensors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
  source: str = "<memory>"

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def targets(self) -> tuple[str, ...]:
    return tuple(p for p in PROJECTIONS if any(k[1] == p for k in self.tensors))


# Each projection's tensor kind in hf's name table (its HF layout and ours).
_KIND_OF = {"q_proj": "q_proj", "k_proj": "kv_proj", "v_proj": "kv_proj", "o_proj": "o_proj"}


def _module_names(config: ModelConfig) -> dict[str, str]:
  return _MODULE_NAMES[config.family.tensor_names]


def read_adapter(directory: str, config: ModelConfig) -> Adapter:
  """A PEFT LoRA folder for a model of `config`; every problem is one ValueError line."""
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"adapter folder {directory!r} does not exist")
  cfg_path = os.path.join(directory, ADAPTER_CONFIG)
  weights = os.path.join(directory, ADAPTER_WEIGHTS)
  for path in (cfg_path, weights):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"adapter folder {directory!r} has no {os.path.basename(path)}")
  cfg = fileio.read_json(cfg_path)
  if not isinstance(cfg, dict):
    raise ValueError(f"{cfg_path}: expected a JSON object")
  if cfg.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{cfg_path}: peft_type={cfg.get('peft_type')!r}; only LORA adapters load")
  rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
  if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
    raise ValueError(f"{cfg_path}: r must be a positive int, got {rank!r}")
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
    raise ValueError(f"{cfg_path}: lora_alpha must be a positive number, got {alpha!r}")
  for key, default in _UNSUPPORTED.items():
    value = cfg.get(key, default)
    if not (value is None or value == default or (isinstance(default, dict) and not value)):
      raise ValueError(f"{cfg_path}: {key}={cfg[key]!r} is not supported (only plain LoRA: "
                       f"{key}={default!r})")
  names = _module_names(config)
  by_module = {v: k for k, v in names.items()}
  targets = cfg.get("target_modules")
  if isinstance(targets, str):
    targets = [targets]
  if not isinstance(targets, list) or not targets:
    raise ValueError(f"{cfg_path}: target_modules must be a non-empty list, got {targets!r}")
  unknown = sorted(set(targets) - set(by_module))
  if unknown:
    raise ValueError(f"{cfg_path}: target_modules {unknown} are not attention projections of a "
                     f"{config.model_type} model (supported: {sorted(by_module)})")

  tensors = hf.read_safetensors(weights)
  parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
  problems = []
  for name, array in sorted(tensors.items()):
    base = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    for side in ("lora_A", "lora_B"):
      for marker in (f".{side}.weight", f".{side}.default.weight"):
        if base.endswith(marker):
          module = base[:-len(marker)]
          break
      else:
        continue
      found = hf.tensor_kind(module + ".weight", config)
      proj = module.rsplit(".", 1)[-1]
      if found is None or proj not in by_module or found[0] not in ("q_proj", "kv_proj",
                                                                    "o_proj"):
        problems.append(f"tensor {name!r} adapts no attention projection of a "
                        f"{config.model_type} model")
        break
      layer = found[1]
      if layer >= config.num_layers:
        problems.append(f"tensor {name!r}: layer {layer}, but the model has {config.num_layers}")
        break
      parts.setdefault((layer, by_module[proj]), {})[side] = array
      break
    else:
      problems.append(f"unexpected tensor {name!r} (not a lora_A / lora_B weight)")
  out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
  for (layer, proj), ab in sorted(parts.items()):
    if set(ab) != {"lora_A", "lora_B"}:
      problems.append(f"layer {layer} {proj}: only {sorted(ab)} present")
      continue
    a, b = np.asarray(ab["lora_A"], np.float32), np.asarray(ab["lora_B"], np.float32)
    out_dim, in_dim = hf.hf_shape(_KIND_OF[proj], config)
    if a.shape != (rank, in_dim) or b.shape != (out_dim, rank):
      problems.append(f"layer {layer} {proj}: lora_A {list(a.shape)} and lora_B "
                      f"{list(b.shape)}, but r={rank} and the model's {names[proj]} is "
                      f"[{out_dim}, {in_dim}] (an adapter for another base?)")
      continue
    out[layer, proj] = (a, b)
  if not problems and not out:
    problems.append("no lora_A / lora_B tensors")
  if problems:
    raise ValueError(f"LoRA adapter {directory!r} does not fit the model "
                     f"({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems))
  return Adapter(rank=rank, alpha=float(alpha), tensors=out, source=directory)


def _lora_key(layer: int, proj: str, factor: str) -> tuple:
  """The state path of qwix's factor ("a" or "b") of one layer's projection."""
  return ("layers", layer, "attn", f"{proj}_lora_{factor}")


def merge(model, adapter: Adapter):
  """`model` (an unrolled `Transformer`) with `W + (alpha / r) B A` in every adapted projection,
  computed in float32 and stored in the weight's dtype. The model is updated in place
  and returned."""
  config = model.config
  if config.scan_layers:
    raise ValueError("lora.merge: a model with scanned layers is not supported")
  for (layer, proj), (a, b) in adapter.tensors.items():
    param = getattr(model.layers[layer].attn, proj)
    delta = hf.to_ours(_KIND_OF[proj], adapter.scale * (b @ a), config)
    w = param[...]
    param[...] = (jnp.asarray(w, jnp.float32) + jnp.asarray(delta)).astype(w.dtype)
  return model


def apply(model, rank: int, alpha: float, *, dropout: float = 0.0, seed: int = 0):
  """A copy of `model` whose attention projections carry live LoRA parameters (qwix;
  A drawn by qwix's initialiser, B zero: the copy computes what `model` does)."""
  if model.config.scan_layers:
    raise ValueError("LoRA on a model with scanned layers is not supported (qwix wraps one "
                     "module per layer); set model.scan_layers=false")
  rule = qwix.LoraRule(module_path=r".*attn", rank=int(rank), alpha=float(alpha),
                       dropout=float(dropout))
  ids = jnp.zeros((1, 2), jnp.int32)
  positions = jnp.arange(2, dtype=jnp.int32)[None]
  with warnings.catch_warnings():  # qwix 0.1.8 reads Variable.value (deprecated in flax)
    warnings.simplefilter("ignore", DeprecationWarning)
    lora_model = qwix.apply_lora_to_model(model, qwix.LoraProvider([rule]), ids, positions,
                                          rngs=nnx.Rngs(seed))
  # qwix copies the weight's logical axes onto A and B, whose axes differ: replicate them
  # (rank-r factors are small).
  for path, var in nnx.to_flat_state(nnx.state(lora_model, nnx.LoRAParam)):
    var.set_metadata("logical_axes", (None,) * var.get_value().ndim)
    del path
  return lora_model


def _qwix_pair(config: ModelConfig, proj: str, a: np.ndarray, b: np.ndarray):
  """PEFT's `(A [r, in], B [out, r])` as qwix's `(A, B)` for our einsums."""
  r = a.shape[0]
  if proj == "o_proj":
    return a.T.reshape(config.num_heads, config.head_dim, r), b.T
  heads = config.num_heads if proj == "q_proj" else config.num_kv_heads
  return a.T, b.T.reshape(r, heads, config.head_dim)


def _peft_pair(config: ModelConfig, proj: str, qa: np.ndarray, qb: np.ndarray):
  """qwix's `(A, B)` as PEFT's `(A [r, in], B [out, r])`."""
  if proj == "o_proj":
    r = qa.shape[-1]
    return qa.reshape(-1, r).T, qb.T
  r = qa.shape[-1]
  return qa.T, qb.reshape(r, -1).T


def _lora_vars(lora_model):
  return {tuple(path): var for path, var in nnx.to_flat_state(
      nnx.state(lora_model, nnx.LoRAParam))}


def load_into(lora_model, adapter: Adapter) -> None:
  """Sets `apply`'s LoRA parameters from `adapter` (its rank and alpha must be the
  model's; projections the adapter does not name get B = 0)."""
  config = lora_model.config
  variables = _lora_vars(lora_model)
  for (layer, proj) in [(i, p) for i in range(config.num_layers) for p in PROJECTIONS]:
    va, vb = variables[_lora_key(layer, proj, "a")], variables[_lora_key(layer, proj, "b")]
    if va.get_value().shape[-1] != adapter.rank:
      raise ValueError(f"LoRA rank {adapter.rank} of {adapter.source!r}, but the model's "
                       f"adapter has rank {va.get_value().shape[-1]}")
    if (layer, proj) in adapter.tensors:
      qa, qb = _qwix_pair(config, proj, *adapter.tensors[layer, proj])
    else:
      qa, qb = np.asarray(va.get_value()), np.zeros(vb.get_value().shape, np.float32)
    va.set_value(jnp.asarray(qa, va.get_value().dtype))
    vb.set_value(jnp.asarray(qb, vb.get_value().dtype))


def extract(lora_model, alpha: float) -> Adapter:
  """`apply`'s live LoRA parameters as an `Adapter` (PEFT's layout, float32)."""
  config = lora_model.config
  variables = _lora_vars(lora_model)
  tensors, rank = {}, None
  for layer in range(config.num_layers):
    for proj in PROJECTIONS:
      qa = np.asarray(variables[_lora_key(layer, proj, "a")].get_value(), np.float32)
      qb = np.asarray(variables[_lora_key(layer, proj, "b")].get_value(), np.float32)
      rank = qa.shape[-1]
      tensors[layer, proj] = _peft_pair(config, proj, qa, qb)
  return Adapter(rank=rank, alpha=float(alpha), tensors=tensors)


def save_adapter(directory: str, config: ModelConfig, adapter: Adapter, *,
                 base_model: str = "", dropout: float = 0.0) -> None:
  """Writes `adapter` as a PEFT folder (float32 tensors), the files replaced atomically."""
  names = _module_names(config)
  table = {"hf": "model.layers.{i}.self_attn.{m}", "llada": "model.transformer.blocks.{i}.{m}"}[
      config.family.tensor_names]
  tensors = {}
  for (layer, proj), (a, b) in sorted(adapter.tensors.items()):
    module = _PREFIX + table.format(i=layer, m=names[proj])
    for side, x in (("lora_A", a), ("lora_B", b)):
      tensors[f"{module}.{side}.weight"] = np.asarray(x, np.float32)
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, ADAPTER_WEIGHTS + ".tmp")
  hf.write_safetensors(tmp, tensors)
  os.replace(tmp, os.path.join(directory, ADAPTER_WEIGHTS))
  cfg: dict[str, Any] = {
      "peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.alpha,
      "lora_dropout": dropout, "bias": "none", "task_type": "CAUSAL_LM",
      "target_modules": sorted({names[p] for _, p in adapter.tensors}),
      "base_model_name_or_path": base_model, "use_rslora": False, "use_dora": False,
      "fan_in_fan_out": False}
  fileio.write_json_atomic(os.path.join(directory, ADAPTER_CONFIG), cfg)
