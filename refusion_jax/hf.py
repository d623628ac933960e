"""Hugging Face Qwen3 / Qwen2 / Dream / Llama checkpoints (config.json + safetensors) <-> our NNX model.

`load` reads a transformers `Qwen3ForCausalLM`, `Qwen2ForCausalLM` (Qwen2.5) or
`LlamaForCausalLM` (Llama-3 / 3.1) folder, a LLaDA-8B one (its own tensor names,
`_LLADA_TABLE`, and config keys, `config.from_hf_config`), or a Dream-7B one (`model_type` "Dream": Qwen2.5's tensor names and
shapes, read as a bidirectional model whose logits are shifted by one,
`ModelConfig.shift_logits`; its config.json's `mask_token_id` is required)
(one `model.safetensors`
or shards listed by `model.safetensors.index.json`) straight into the target
sharding and dtype: the model is built abstractly, each tensor is memory-mapped
from its file and every device reads only its own slice, so the float32 model
never exists in full on one host. `save` writes the same layout back, one
tensor in host memory at a time, into a temporary folder renamed into place.

The safetensors format (8-byte little-endian header length, a JSON header,
raw little-endian data) is read and written here directly: that gives lazy
per-slice reads through `np.memmap` and handles bfloat16 through `ml_dtypes`
whatever the installed `safetensors` version supports.

Tied embeddings: when config.json says `tie_word_embeddings=true` the model
has no separate head. A checkpoint may still carry `lm_head.weight` (some
exporters write the shared matrix twice); it is accepted only when it equals
`model.embed_tokens.weight` exactly, otherwise loading it would silently drop
a trained head, so it is reported as a problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import struct
import tempfile
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from refusion_jax import config as config_lib
from refusion_jax import fileio, sharding
from refusion_jax.config import ModelConfig
from refusion_jax.model import Transformer

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size

_ST_TO_NP = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")
# Buffers some exporters write that carry nothing (derived from config.json).
_IGNORED = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


# --------------------------------------------------------------------------
# Name and layout table. HF Linear weights are [out, in]; ours are [in, ...out].
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Kind:
  """How one kind of tensor is laid out on each side."""

  hf_shape: Callable[[ModelConfig], tuple[int, ...]]
  to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]  # views only, no copy
  to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]


def _proj_in(heads: Callable[[ModelConfig], int]) -> _Kind:
  # HF [heads*H, D] <-> ours [D, heads, H].
  return _Kind(
      hf_shape=lambda c: (heads(c) * c.head_dim, c.hidden_size),
      to_ours=lambda w, c: w.reshape(heads(c), c.head_dim, c.hidden_size).transpose(2, 0, 1),
      to_hf=lambda x, c: x.transpose(1, 2, 0).reshape(heads(c) * c.head_dim, c.hidden_size))


def _transposed(shape: Callable[[ModelConfig], tuple[int, int]]) -> _Kind:
  return _Kind(hf_shape=shape, to_ours=lambda w, c: w.T, to_hf=lambda x, c: x.T)


def _same(shape: Callable[[ModelConfig], tuple[int, ...]]) -> _Kind:
  return _Kind(hf_shape=shape, to_ours=lambda w, c: w, to_hf=lambda x, c: x)


_KINDS = {
    "embed": _same(lambda c: (c.vocab_size, c.hidden_size)),
    "q_proj": _proj_in(lambda c: c.num_heads),
    "kv_proj": _proj_in(lambda c: c.num_kv_heads),
    # HF [D, N*H] <-> ours [N, H, D].
    "o_proj": _Kind(
        hf_shape=lambda c: (c.hidden_size, c.num_heads * c.head_dim),
        to_ours=lambda w, c: w.reshape(c.hidden_size, c.num_heads, c.head_dim).transpose(1, 2, 0),
        to_hf=lambda x, c: x.transpose(2, 0, 1).reshape(c.hidden_size, c.num_heads * c.head_dim)),
    "mlp_in": _transposed(lambda c: (c.mlp_dim, c.hidden_size)),  # HF [F, D] <-> ours [D, F]
    "mlp_out": _transposed(lambda c: (c.hidden_size, c.mlp_dim)),  # HF [D, F] <-> ours [F, D]
    "norm": _same(lambda c: (c.hidden_size,)),
    "head_norm": _same(lambda c: (c.head_dim,)),
    # Qwen2's projection biases: HF [heads*H] <-> ours [heads, H].
    "q_bias": _Kind(hf_shape=lambda c: (c.num_heads * c.head_dim,),
                    to_ours=lambda w, c: w.reshape(c.num_heads, c.head_dim),
                    to_hf=lambda x, c: x.reshape(c.num_heads * c.head_dim)),
    "kv_bias": _Kind(hf_shape=lambda c: (c.num_kv_heads * c.head_dim,),
                     to_ours=lambda w, c: w.reshape(c.num_kv_heads, c.head_dim),
                     to_hf=lambda x, c: x.reshape(c.num_kv_heads * c.head_dim)),
    "lm_head": _transposed(lambda c: (c.vocab_size, c.hidden_size)),  # HF [V, D] <-> ours [D, V]
}

# (HF name, our state path, kind), in the order HF files list them. "{i}" is the layer.
_TABLE = (
    ("model.embed_tokens.weight", ("embed",), "embed"),
    ("model.layers.{i}.input_layernorm.weight", ("layers", "{i}", "input_norm", "scale"), "norm"),
    ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "{i}", "attn", "q_proj"), "q_proj"),
    ("model.layers.{i}.self_attn.q_proj.bias", ("layers", "{i}", "attn", "q_bias"), "q_bias"),
    ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "{i}", "attn", "k_proj"), "kv_proj"),
    ("model.layers.{i}.self_attn.k_proj.bias", ("layers", "{i}", "attn", "k_bias"), "kv_bias"),
    ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "{i}", "attn", "v_proj"), "kv_proj"),
    ("model.layers.{i}.self_attn.v_proj.bias", ("layers", "{i}", "attn", "v_bias"), "kv_bias"),
    ("model.layers.{i}.self_attn.o_proj.weight", ("layers", "{i}", "attn", "o_proj"), "o_proj"),
    ("model.layers.{i}.self_attn.q_norm.weight", ("layers", "{i}", "attn", "q_norm", "scale"),
     "head_norm"),
    ("model.layers.{i}.self_attn.k_norm.weight", ("layers", "{i}", "attn", "k_norm", "scale"),
     "head_norm"),
    ("model.layers.{i}.post_attention_layernorm.weight",
     ("layers", "{i}", "post_attn_norm", "scale"), "norm"),
    ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "{i}", "mlp", "gate_proj"), "mlp_in"),
    ("model.layers.{i}.mlp.up_proj.weight", ("layers", "{i}", "mlp", "up_proj"), "mlp_in"),
    ("model.layers.{i}.mlp.down_proj.weight", ("layers", "{i}", "mlp", "down_proj"), "mlp_out"),
    ("model.norm.weight", ("final_norm", "scale"), "norm"),
    ("lm_head.weight", ("lm_head",), "lm_head"),
)
# LLaDA's own names for the same tensors (LLaDA-8B's OLMo-derived code): attn_out is
# o_proj, ff_proj the gate, ff_out in a block the down projection and at the top the head.
_LLADA_TABLE = (
    ("model.transformer.wte.weight", ("embed",), "embed"),
    ("model.transformer.blocks.{i}.attn_norm.weight", ("layers", "{i}", "input_norm", "scale"),
     "norm"),
    ("model.transformer.blocks.{i}.q_proj.weight", ("layers", "{i}", "attn", "q_proj"), "q_proj"),
    ("model.transformer.blocks.{i}.k_proj.weight", ("layers", "{i}", "attn", "k_proj"),
     "kv_proj"),
    ("model.transformer.blocks.{i}.v_proj.weight", ("layers", "{i}", "attn", "v_proj"),
     "kv_proj"),
    ("model.transformer.blocks.{i}.attn_out.weight", ("layers", "{i}", "attn", "o_proj"),
     "o_proj"),
    ("model.transformer.blocks.{i}.ff_norm.weight", ("layers", "{i}", "post_attn_norm", "scale"),
     "norm"),
    ("model.transformer.blocks.{i}.ff_proj.weight", ("layers", "{i}", "mlp", "gate_proj"),
     "mlp_in"),
    ("model.transformer.blocks.{i}.up_proj.weight", ("layers", "{i}", "mlp", "up_proj"),
     "mlp_in"),
    ("model.transformer.blocks.{i}.ff_out.weight", ("layers", "{i}", "mlp", "down_proj"),
     "mlp_out"),
    ("model.transformer.ln_f.weight", ("final_norm", "scale"), "norm"),
    ("model.transformer.ff_out.weight", ("lm_head",), "lm_head"),
)
# Each family's table (`config.Family.tensor_names`); the embedding comes first in each.
_TABLES = {"hf": _TABLE, "llada": _LLADA_TABLE}
_EMBED_NAMES = tuple(table[0][0] for table in _TABLES.values())
_REGEXES = {
    key: tuple((re.compile(re.escape(name).replace(re.escape("{i}"), r"(\d+)") + r"\Z"),
                path, kind) for name, path, kind in table)
    for key, table in _TABLES.items()}


def _our_path(path: tuple, layer: int | None, scanned: bool) -> tuple[tuple, int | None]:
  """`(our state path, index on its stacked layer axis)` of a table path at `layer`.

  Unrolled models keep a module per layer (`("layers", 3, "attn", ...)`); scanned
  models stack every layer's tensor on a leading axis (`("layers", "attn", ...)`,
  index 3). One table serves both layouts: import stacks, export slices.
  """
  if "{i}" not in path:
    return path, None
  if scanned:
    return tuple(p for p in path if p != "{i}"), layer
  return tuple(layer if p == "{i}" else p for p in path), None


def _match(hf_name: str, table: str):
  """`(table path, kind, layer)` of a HF tensor name of a family whose names are
  `table`'s (layer None outside the layers), or None when no rule matches."""
  for regex, path, kind in _REGEXES[table]:
    m = regex.match(hf_name)
    if m:
      return path, kind, int(m.group(1)) if m.groups() else None
  return None


def _parse_name(hf_name: str, scanned: bool = False, table: str = "hf"):
  """`(our_path, kind, stacked_index)` for a HF tensor name of a family whose names are
  `table`'s, or None when no rule matches."""
  matched = _match(hf_name, table)
  if matched is None:
    return None
  path, kind, layer = matched
  ours, index = _our_path(path, layer, scanned)
  return ours, kind, index


def _has(kind: str, config: ModelConfig) -> bool:
  """Whether a model of `config` has tensors of this kind (its family's, an untied head)."""
  if kind == "head_norm":
    return config.qk_norm
  if kind in ("q_bias", "kv_bias"):
    return config.qkv_bias
  if kind == "lm_head":
    return not config.tie_embeddings
  return True


def _hf_names(config: ModelConfig):
  """`[(hf_name, our_path, kind, stacked_index)]` for every tensor of `config`, in HF
  file order (`stacked_index` is the layer on a scanned model's stacked axis, else None)."""
  table = [t for t in _TABLES[config.family.tensor_names] if _has(t[2], config)]
  out = [(name, path, kind, None) for name, path, kind in table if "{i}" not in name]
  per_layer = [t for t in table if "{i}" in t[0]]
  layers = []
  for i in range(config.num_layers):
    for name, path, kind in per_layer:
      ours, index = _our_path(path, i, config.scan_layers)
      layers.append((name.replace("{i}", str(i)), ours, kind, index))
  return out[:1] + layers + out[1:]


# --------------------------------------------------------------------------
# safetensors reading (lazy) and writing.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
  name: str
  path: str
  code: str  # safetensors dtype code, e.g. "BF16"
  shape: tuple[int, ...]
  offset: int  # absolute byte offset of the data in the file

  @property
  def dtype(self) -> np.dtype:
    return _ST_TO_NP[self.code]

  def array(self) -> np.ndarray:
    """A read-only memory map: nothing is read until it is sliced."""
    if math.prod(self.shape) == 0:
      return np.zeros(self.shape, self.dtype)
    return np.memmap(self.path, dtype=self.dtype.newbyteorder("<"), mode="r",
                     offset=self.offset, shape=self.shape)


def _read_header(path: str) -> dict[str, _Tensor]:
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise ValueError(f"{path}: not a safetensors file (only {len(raw)} bytes)")
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > size - 8:
      raise ValueError(f"{path}: not a safetensors file (header length {header_len} exceeds "
                       f"the file size {size})")
    try:
      header = json.loads(f.read(header_len))
    except (ValueError, RecursionError) as e:  # not JSON or UTF-8, too long a number, too deep
      raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                     "not an object of tensors)")
  base = 8 + header_len
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if not (isinstance(info, dict) and isinstance(info.get("shape"), list)
            and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
            and all(isinstance(x, int) and x >= 0 for x in info["shape"] + info["data_offsets"])):
      raise ValueError(f"{path}: tensor {name!r} has a corrupt header entry {str(info)[:200]} "
                       "(expected dtype, shape and two data_offsets)")
    code = info.get("dtype")
    if code not in _ST_TO_NP:
      raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
    shape = tuple(int(s) for s in info["shape"])
    start, end = (int(o) for o in info["data_offsets"])
    if end - start != math.prod(shape) * _ST_TO_NP[code].itemsize or base + end > size:
      raise ValueError(f"{path}: tensor {name!r} has inconsistent data_offsets {[start, end]} "
                       f"for shape {list(shape)} {code} (file is {size} bytes; truncated?)")
    tensors[name] = _Tensor(name, path, code, shape, base + start)
  return tensors


def _tensor_files(directory: str) -> list[str]:
  """The safetensors files of a checkpoint folder (index first, then the single file)."""
  index_path = os.path.join(directory, INDEX_FILE)
  if os.path.exists(index_path):
    index = fileio.read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index_path}: no 'weight_map' of tensor name -> file")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.exists(os.path.join(directory, f))]
    if missing:
      raise FileNotFoundError(f"{index_path} names shard file(s) that do not exist: {missing}")
    return [os.path.join(directory, f) for f in files]
  single = os.path.join(directory, SAFETENSORS_FILE)
  if os.path.exists(single):
    return [single]
  others = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
  hint = f" (found {others} but no {INDEX_FILE} to say how they fit together)" if others else ""
  raise FileNotFoundError(
      f"no safetensors weights in {directory}: expected {SAFETENSORS_FILE} or {INDEX_FILE}{hint}")


def _read_all_headers(directory: str) -> dict[str, _Tensor]:
  tensors: dict[str, _Tensor] = {}
  for path in _tensor_files(directory):
    for name, t in _read_header(path).items():
      if name in tensors:
        raise ValueError(f"tensor {name!r} appears in both {tensors[name].path} and {path}")
      tensors[name] = t
  return tensors


def _write_safetensors(path: str, entries, fetch: Callable[[int], np.ndarray]) -> None:
  """Writes `entries` ([(name, code, shape)]) with data from `fetch(i)`, one at a time."""
  header, offset = {}, 0
  for name, code, shape in entries:
    nbytes = math.prod(shape) * _ST_TO_NP[code].itemsize
    header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  header["__metadata__"] = {"format": "pt"}  # transformers refuses files without it
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for i, (name, code, shape) in enumerate(entries):
      data = np.ascontiguousarray(fetch(i), dtype=_ST_TO_NP[code].newbyteorder("<"))
      if data.shape != tuple(shape):
        raise AssertionError(f"{name}: produced shape {data.shape}, header says {shape}")
      f.write(data.tobytes())


# --------------------------------------------------------------------------
# The name table and safetensors files, for formats over the same tensors (LoRA
# adapters name the projections they adapt by their HF names, in HF's layout).
# --------------------------------------------------------------------------


def tensor_kind(hf_name: str, config: ModelConfig) -> tuple[str, int | None] | None:
  """`(kind, layer)` of a HF tensor name in the names of `config`'s family (kind: a key
  of the layout table, e.g. "q_proj", "kv_proj", "o_proj"; layer None outside the
  layers), or None when it names no tensor of that family."""
  matched = _match(hf_name, config.family.tensor_names)
  return None if matched is None else matched[1:]


def hf_shape(kind: str, config: ModelConfig) -> tuple[int, ...]:
  """The shape of a `kind` tensor of a model of `config` in HF's layout (a Linear weight:
  `[out, in]`)."""
  return tuple(_KINDS[kind].hf_shape(config))


def to_ours(kind: str, hf_array: np.ndarray, config: ModelConfig) -> np.ndarray:
  """A `kind` tensor in HF's layout as our parameter's layout (a view where it can be)."""
  return _KINDS[kind].to_ours(hf_array, config)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of one safetensors file by name, memory-mapped (read when sliced);
  a malformed file is one ValueError naming it."""
  return {name: t.array() for name, t in _read_header(path).items()}


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes `tensors` (name -> array, each in its own dtype) to one safetensors file, in
  that order."""
  arrays = [np.asarray(x) for x in tensors.values()]
  entries = []
  for name, x in zip(tensors, arrays):
    if x.dtype not in _NP_TO_ST:
      raise ValueError(f"write_safetensors: tensor {name!r} has dtype {x.dtype}, which "
                       f"safetensors does not hold (its dtypes: {sorted(_ST_TO_NP)})")
    entries.append((name, _NP_TO_ST[x.dtype], tuple(x.shape)))
  _write_safetensors(path, entries, lambda i: arrays[i])


# --------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------


def _dtype_name(dtype) -> str:
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = repr(dtype)
  allowed = ("float32", "bfloat16", "float16")
  if name not in allowed:
    raise ValueError(f"hf.load: dtype must be one of {allowed}, got {dtype!r}")
  return name


def _abstract_model(config: ModelConfig):

  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)


def _arrays_equal(a: np.ndarray, b: np.ndarray, rows: int = 4096) -> bool:
  """Equality of two memory-mapped matrices, a block of rows at a time."""
  if a.shape != b.shape:
    return False
  return all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, a.shape[0], rows))


def _check_folder(directory: str) -> None:
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"HF checkpoint folder {directory!r} does not exist")
  if not os.path.exists(os.path.join(directory, CONFIG_FILE)):
    raise FileNotFoundError(f"no {CONFIG_FILE} in {directory!r}: not a HF checkpoint folder")


def _config(directory: str, tensors: Mapping[str, _Tensor], **overrides) -> ModelConfig:
  """config.json with the vocabulary size taken from the embedding tensor's rows
  (ReFusion resizes Qwen3's 151936 rows to 151671 while config.json may keep the old
  value)."""
  embed = next((tensors[n] for n in _EMBED_NAMES if n in tensors), None)
  if embed is not None and len(embed.shape) == 2:
    overrides["vocab_size"] = embed.shape[0]
  return config_lib.from_hf_config(directory, **overrides)


def read_config(directory: str) -> ModelConfig:
  """The `ModelConfig` that `load` builds for a HF checkpoint folder (no `dtype` or
  `scan_layers` given), from config.json and the safetensors headers only."""
  directory = os.fspath(directory)
  _check_folder(directory)
  return _config(directory, _read_all_headers(directory))


def load(directory: str, *, mesh=None, rules: sharding.ShardingRules | None = None,
         dtype=None, scan_layers: bool = False):
  """Loads a HF Qwen3, Qwen2 / Qwen2.5, Dream or Llama checkpoint folder. Returns `(config, model)`.

  Args:
    directory: folder with `config.json` and `model.safetensors` (or shards
      listed by `model.safetensors.index.json`).
    mesh: place parameters on this mesh following `rules` (default: the first
      local device, unsharded).
    rules: logical -> mesh axis rules (default `sharding.ShardingRules()`).
    dtype: parameter and compute dtype ("float32", "bfloat16", "float16" or a
      jnp dtype); None keeps config.json's `torch_dtype` / `dtype`.
    scan_layers: build the scanned layout (`ModelConfig.scan_layers`): each
      layer tensor of the file becomes one slice of a stacked parameter.

  The vocabulary size is the embedding tensor's row count (ReFusion resizes
  Qwen3's 151936 rows to 151671 while config.json may keep the old value).
  Every missing, unexpected or mis-shaped tensor is reported in one ValueError.
  """

  directory = os.fspath(directory)
  _check_folder(directory)
  tensors = _read_all_headers(directory)

  overrides = {}
  if dtype is not None:
    name = _dtype_name(dtype)
    overrides.update(dtype=name, param_dtype=name)
  if scan_layers:
    overrides["scan_layers"] = True
  config = _config(directory, tensors, **overrides)
  embed_name = _TABLES[config.family.tensor_names][0][0]
  embed = tensors.get(embed_name)

  graphdef, abstract_state = _abstract_model(config)
  targets = dict(nnx.to_flat_state(abstract_state))
  problems: list[str] = []
  reported: set[str] = set()  # names already in `problems` (not "missing" again)
  found: dict[tuple, tuple[_Tensor, str]] = {}
  for name in sorted(tensors):
    t = tensors[name]
    parsed = _parse_name(name, config.scan_layers, config.family.tensor_names)
    if parsed is None:
      if not _IGNORED.fullmatch(name):
        problems.append(f"unexpected tensor {name!r} (no parameter of a "
                        f"{config_lib.HF_MODEL_TYPES[config.model_type]} model has this name)")
      continue
    path, kind, index = parsed
    reported.add(name)
    if kind == "lm_head" and config.tie_embeddings:
      if embed is None or not _arrays_equal(t.array(), embed.array()):
        problems.append(
            f"tensor {name!r} differs from {embed_name!r} but config.json ties the "
            "embeddings (the head would be silently dropped; untie them to keep it)")
      continue
    if not _has(kind, config) and kind != "lm_head":
      problems.append(f"unexpected tensor {name!r} (a {config.model_type} model has none: "
                      f"config.json says model_type="
                      f"{config_lib.HF_MODEL_TYPES[config.model_type]!r})")
      continue
    if path not in targets or (index is not None and index >= config.num_layers):
      problems.append(f"unexpected tensor {name!r} (config.json has num_hidden_layers="
                      f"{config.num_layers})")
      continue
    expected = _KINDS[kind].hf_shape(config)
    if t.shape != expected:
      problems.append(f"tensor {name!r} has shape {list(t.shape)}, expected {list(expected)} "
                      "from config.json")
      continue
    if t.code not in _FLOAT_CODES:
      problems.append(f"tensor {name!r} has dtype {t.code}, expected a floating type")
      continue
    found[path, index] = (t, kind)
  for name, path, kind, index in _hf_names(config):
    if (path, index) not in found and name not in reported:
      problems.append(f"missing tensor {name!r}")
  if problems:
    raise ValueError(f"HF checkpoint {directory!r} does not match its config.json "
                     f"({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems))

  if mesh is not None:
    shardings = dict(nnx.to_flat_state(
        sharding.state_shardings(abstract_state, mesh, rules or sharding.ShardingRules())))
    sharding_of = lambda path: shardings[path].get_value()
  else:
    device = SingleDeviceSharding(jax.local_devices()[0])
    sharding_of = lambda path: device

  target_dtype = np.dtype(config.weight_dtype)
  leaves = []
  for path, var in targets.items():
    stacked = (path, None) not in found  # a scanned layer tensor: one file tensor per layer
    if stacked:
      parts = [found[path, i] for i in range(config.num_layers)]
      views = [_KINDS[kind].to_ours(t.array(), config) for t, kind in parts]
      shape = (len(views),) + views[0].shape
      name = parts[0][0].name
    else:
      t, kind = found[path, None]
      views = [_KINDS[kind].to_ours(t.array(), config)]
      shape, name = views[0].shape, t.name
    if shape != var.get_value().shape:
      raise AssertionError(f"{name}: mapped to {shape}, model wants {var.get_value().shape}")
    cache: dict[str, np.ndarray] = {}

    def read(index, views=views, stacked=stacked, cache=cache):
      # Replicated devices ask for the same slice; read it from disk once.
      key = repr(index)
      if key not in cache:
        if stacked:  # the device's layers, each sliced from its own file tensor
          layers = range(len(views))[index[0]]
          part = np.stack([views[i][index[1:]] for i in layers])
        else:
          part = views[0][index]
        cache[key] = np.ascontiguousarray(part).astype(target_dtype)
      return cache[key]

    value = jax.make_array_from_callback(shape, sharding_of(path), read)
    leaves.append((path, var.replace(value)))
  state = nnx.from_flat_state(leaves)
  return config, nnx.merge(graphdef, state)


def _to_host(array) -> np.ndarray:
  if getattr(array, "is_fully_addressable", True):
    return np.asarray(jax.device_get(array))

  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def save(config: ModelConfig, model: nnx.Module, directory: str, *,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
         extra_files: Mapping[str, str] | None = None) -> None:
  """Writes `model` as a HF folder of its family (`config.to_hf_config`): Qwen3ForCausalLM
  or Qwen2ForCausalLM, which transformers can load, or Dream's layout (`DreamModel`,
  which transformers runs beside Dream's own modeling code).

  Writes `config.json` plus `model.safetensors`, or, when the tensors exceed
  `max_shard_bytes`, `model-0000i-of-0000n.safetensors` shards and
  `model.safetensors.index.json`. Tensors keep the parameters' dtype. The
  folder is written under a temporary name and renamed into place, so a
  failure leaves nothing half-written. Only process 0 writes files.
  `extra_files` ({name: text}) are written into the folder before it is renamed
  into place (the trainer's export marker).
  """
  if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
    raise ValueError(f"hf.save: max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
  if config.draft_rank:
    raise ValueError(f"hf.save: the model has draft adapters (ModelConfig.draft_rank="
                     f"{config.draft_rank}), which no HF family has; keep it as a refusion_jax "
                     "folder (checkpoint.save_model)")
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory) and not overwrite:
    raise FileExistsError(f"{directory} already exists (pass overwrite=True to replace it)")
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  problems, entries, used = [], [], set()
  for name, path, kind, index in _hf_names(config):
    var = params.get(path)
    if var is None:
      problems.append(f"model has no parameter {'/'.join(map(str, path))} for {name!r}")
      continue
    used.add(path)
    value = var.get_value()
    expected = _KINDS[kind].hf_shape(config)
    ours = _KINDS[kind].to_ours(np.empty(expected, np.int8), config).shape
    if index is not None:  # one layer of a scanned model's stacked parameter
      ours = (config.num_layers,) + ours
    if tuple(value.shape) != ours:
      problems.append(f"parameter {'/'.join(map(str, path))} has shape {list(value.shape)}, "
                      f"config implies {list(ours)}")
      continue
    code = _NP_TO_ST.get(np.dtype(value.dtype))
    if code not in _FLOAT_CODES:
      problems.append(f"parameter {'/'.join(map(str, path))} has unsupported dtype {value.dtype}")
      continue
    entries.append((name, code, expected, value, kind, index))
  problems += [f"model parameter {'/'.join(map(str, p))} has no HF name"
               for p in params if p not in used]
  if problems:
    raise ValueError("hf.save: model does not match its config:\n  - " + "\n  - ".join(problems))

  # Greedy shards in file order; a tensor larger than the limit gets its own.
  shards: list[list] = [[]]
  size = 0
  for entry in entries:
    nbytes = math.prod(entry[2]) * _ST_TO_NP[entry[1]].itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  if len(shards) == 1:
    file_names = [SAFETENSORS_FILE]
  else:
    file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

  writer = jax.process_index() == 0
  tmp = None
  if writer:
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp_hf_", dir=parent)
  try:
    for file_name, shard in zip(file_names, shards):

      def fetch(i, shard=shard):
        _, _, _, value, kind, index = shard[i]
        if index is not None:  # slice the layer on its devices, then fetch only it
          value = value[index]
        return _KINDS[kind].to_hf(_to_host(value), config)

      if writer:
        _write_safetensors(os.path.join(tmp, file_name), [e[:3] for e in shard], fetch)
      else:  # other processes still take part in the gathers
        for i in range(len(shard)):
          fetch(i)
    if writer:
      if len(shards) > 1:
        total = sum(math.prod(e[2]) * _ST_TO_NP[e[1]].itemsize for e in entries)
        index = {"metadata": {"total_size": total},
                 "weight_map": {e[0]: f for f, shard in zip(file_names, shards) for e in shard}}
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
          json.dump(index, f, indent=2)
      with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        json.dump(config_lib.to_hf_config(config), f, indent=2)
      for name, text in (extra_files or {}).items():
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
          f.write(text)
      if os.path.exists(directory):
        shutil.rmtree(directory)
      os.replace(tmp, directory)
  except BaseException:
    if tmp is not None:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
