"""Static model configuration, presets and the Hugging Face config.json mapping.

`ModelConfig` is a frozen dataclass, so it is hashable and can be a static
argument of `jax.jit`. Dtypes are stored by name for the same reason.
The decoding half, `DecodeConfig`, is decode/settings.py's (each decoding method's
options, decode/methods.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax.numpy as jnp

from refusion_jax import fileio

ATTENTION_KINDS = ("causal", "bidirectional")
# What a layer keeps for the backward pass (jax.checkpoint policies, see model.py):
# "none" keeps everything, "full" only each layer's input, "save_dots" the outputs of
# the weight matmuls (projections and MLP), recomputing attention and elementwise ops.
REMAT_POLICIES = ("none", "full", "save_dots")
# How full-sequence (training) attention is computed: "xla" the einsum reference,
# "splash" the Pallas TPU kernel, "cudnn" jax.nn.dot_product_attention's GPU kernel.
ATTENTION_IMPLS = ("xla", "splash", "cudnn")
# Ids a decoder stops at: EOS and at most this many minus one `ModelConfig.stop_token_ids`
# (a traced array of this size: one program for every model).
MAX_STOP_IDS = 4
# The decode engine's compiled programs (decode/compiled.py `lower_program`): a whole
# decode, an admission into free rows, and a run of passes.
DECODE_PROGRAMS = ("generate", "admit", "run")


@dataclasses.dataclass(frozen=True)
class Family:
  """What a decoder family changes in the shared pre-norm block (RMSNorm, RoPE from
  position ids, grouped-query attention, SwiGLU), as data: one model, one HF table.

  Attributes:
    hf_model_type: its `model_type` in a HF config.json.
    architecture: its `architectures` entry.
    qk_norm: q and k RMS-normalised per head.
    qkv_bias: biases on the q, k and v projections.
    shift_logits: the prediction for token i is the output at position i-1.
    attention: the attention the family has ("bidirectional": always; None: either,
      set by the objective).
    tensor_names: its checkpoint's tensor names (hf.py's tables): "hf", transformers'
      Llama / Qwen names, or "llada", LLaDA's own.
    stop_token_ids: besides EOS, the ids its released chat models end a response with
      (`ModelConfig.stop_token_ids` of a folder read from HF; an id outside a smaller
      vocabulary is left out).
  """

  hf_model_type: str
  architecture: str
  qk_norm: bool = False
  qkv_bias: bool = False
  shift_logits: bool = False
  attention: str | None = None
  tensor_names: str = "hf"
  stop_token_ids: tuple[int, ...] = ()


# Decoder families (ALGORITHM.md "Baselines" and "Table 1's baselines"): Qwen3
# normalises q and k per head; Qwen2 / Qwen2.5 has biases on the q, k and v projections;
# Dream (Dream-7B) is Qwen2.5's layout, bidirectional, logits shifted by one; Llama
# (Llama-3 / 3.1) is the plain block (3.1: the "llama3" RoPE scaling); LLaDA (LLaDA-8B)
# is Llama's block without a causal mask, under its own tensor names and config keys.
FAMILIES = {
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    "dream": Family("Dream", "DreamModel", qkv_bias=True, shift_logits=True,
                    attention="bidirectional"),
    # Llama-3-Instruct ends a turn with <|eot_id|> 128009; base models and the first
    # releases' config.json, with <|end_of_text|> 128001.
    "llama": Family("llama", "LlamaForCausalLM", stop_token_ids=(128001, 128009)),
    # LLaDA-8B-Instruct: EOS <|endoftext|> 126081, end of turn <|eot_id|> 126348.
    "llada": Family("llada", "LLaDAModelLM", attention="bidirectional", tensor_names="llada",
                    stop_token_ids=(126081, 126348)),
}
MODEL_TYPES = tuple(FAMILIES)
# Each family's `model_type` in a HF config.json (Dream's folders say "Dream").
HF_MODEL_TYPES = {name: f.hf_model_type for name, f in FAMILIES.items()}
# Dtypes by name; jax.numpy's types are looked up when asked for, so that reading and
# checking a config (the command lines do it first) does not load JAX.
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and constants of a decoder of one of `FAMILIES` (and ReFusion's special tokens)."""

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 1_000_000.0
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  max_position_embeddings: int = 40960
  dtype: str = "float32"  # compute dtype of activations
  param_dtype: str = "float32"  # storage dtype of parameters
  attention: str = "causal"  # "causal" or "bidirectional" (MDM baseline)
  remat: str = "none"  # REMAT_POLICIES; legacy bools: True = "full", False = "none"
  scan_layers: bool = False  # stacked layer parameters run by lax.scan (fast compiles)
  attention_impl: str = "xla"  # ATTENTION_IMPLS: training attention kernel
  mask_token_id: int | None = None
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  # MODEL_TYPES (FAMILIES): "qwen3" (q/k norm), "qwen2" (q/k/v biases), "dream" (Qwen2's
  # layout, bidirectional, the prediction for token i read from position i-1:
  # `shift_logits`) or "llama" (neither)
  model_type: str = "qwen3"
  # Llama 3.1's "llama3" RoPE scaling (0: none): frequencies whose wavelength exceeds
  # original_max_positions / low_freq_factor are divided by the factor, those below
  # original_max_positions / high_freq_factor kept, the ones between interpolated.
  rope_scaling_factor: float = 0.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 0
  # Ids besides eos_token_id that end a response (Llama-3-Instruct: <|end_of_text|> with
  # <|eot_id|> as EOS; LLaDA-Instruct: <|eot_id|>); decoding stops at any of them.
  stop_token_ids: tuple[int, ...] = ()
  # The objective the weights were trained with ("refusion", "arm", "mdm", "bd3lm"; ""
  # unknown, as in a folder from elsewhere): a decoder that needs its own (BD3-LM's blocks)
  # refuses a model trained otherwise by name. HF config.json: "refusion_jax_objective".
  objective: str = ""
  # Rank of the draft adapters (0: none): a low-rank update of every layer's MLP output,
  # applied at the entries whose input is the mask token and at no other
  # (model.MLP's `draft_a` / `draft_b`). A token entry never attends to a mask entry in a
  # decoding pass, so the adapters change the drafts and never a causal pick: lossless
  # answers stay the model's own (refusion_jax.drafter trains them for acceptance).
  draft_rank: int = 0

  def __post_init__(self):
    if isinstance(self.stop_token_ids, list):  # read back from model_config.json
      object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
    if isinstance(self.remat, bool):  # model_config.json files written before the policies
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"ModelConfig.scan_layers must be a bool, got {self.scan_layers!r}")
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"ModelConfig.model_type must be one of {MODEL_TYPES}, got "
                       f"{self.model_type!r}")
    needs = FAMILIES[self.model_type].attention
    if needs is not None and self.attention != needs:
      raise ValueError(f"ModelConfig.model_type={self.model_type!r} needs attention={needs!r} "
                       f"(the family attends both ways), got attention={self.attention!r}")
    if self.rope_scaling_factor:
      if not self.rope_scaling_factor >= 1.0:
        raise ValueError(f"ModelConfig.rope_scaling_factor must be >= 1 (0: no scaling), got "
                         f"{self.rope_scaling_factor!r}")
      if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
        raise ValueError(f"ModelConfig.rope_low_freq_factor={self.rope_low_freq_factor} and "
                         f"rope_high_freq_factor={self.rope_high_freq_factor} must satisfy "
                         "0 < low < high")
      if (not isinstance(self.rope_original_max_positions, int)
          or self.rope_original_max_positions <= 0):
        raise ValueError(f"ModelConfig.rope_original_max_positions must be a positive int "
                         f"with rope scaling, got {self.rope_original_max_positions!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, got "
                       f"{self.attention_impl!r}")
    if not isinstance(self.draft_rank, int) or isinstance(self.draft_rank, bool) or (
        self.draft_rank < 0):
      raise ValueError(f"ModelConfig.draft_rank must be an int >= 0 (0: none), got "
                       f"{self.draft_rank!r}")
    if self.draft_rank and self.mask_token_id is None:
      raise ValueError("ModelConfig.draft_rank adapts the mask token's entries: the model "
                       "needs a mask_token_id")
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "mlp_dim",
                "max_position_embeddings")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if self.rope_theta <= 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
    if self.rms_eps <= 0:
      raise ValueError(f"ModelConfig.rms_eps must be > 0, got {self.rms_eps}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(
            f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(
          f"ModelConfig.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
    for name in ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
      value = getattr(self, name)
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(
            f"ModelConfig.{name}={value} is outside the vocabulary [0, {self.vocab_size})")
    if not isinstance(self.objective, str):
      raise ValueError(f"ModelConfig.objective must be a string (\"\": unknown), got "
                       f"{self.objective!r}")
    stops = self.stop_token_ids
    if (not isinstance(stops, tuple) or len(stops) > MAX_STOP_IDS - 1
        or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size
               for v in stops)):
      raise ValueError(f"ModelConfig.stop_token_ids must be a tuple of at most "
                       f"{MAX_STOP_IDS - 1} ids in [0, {self.vocab_size}), got {stops!r}")

  @property
  def compute_dtype(self):
    return getattr(jnp, self.dtype)

  @property
  def weight_dtype(self):
    return getattr(jnp, self.param_dtype)

  @property
  def family(self) -> Family:
    return FAMILIES[self.model_type]

  @property
  def qk_norm(self) -> bool:
    """Whether q and k are RMS-normalised per head (Qwen3)."""
    return self.family.qk_norm

  @property
  def qkv_bias(self) -> bool:
    """Whether the q, k and v projections carry biases (Qwen2, Dream)."""
    return self.family.qkv_bias

  @property
  def shift_logits(self) -> bool:
    """Whether the prediction for token i is the output at position i-1 (Dream; position
    0 reads its own): a decoder reads the hidden state one column to the left."""
    return self.family.shift_logits

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.mlp_dim, self.vocab_size
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * self.head_dim
    if self.qkv_bias:
      attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else v * d
    return v * d + self.num_layers * layer + d + head


# Qwen3's tokenizer (Qwen2.5's has the same ids for these): 151643 regular tokens +
# specials; ReFusion appends two.
QWEN3_EOS_ID = 151645  # <|im_end|>
QWEN3_PAD_ID = 151643  # <|endoftext|>
REFUSION_BOS_ID = 151669  # <|beginoftext|>
REFUSION_MASK_ID = 151670  # <|mask|>


def qwen3_8b(**overrides) -> ModelConfig:
  """Qwen3-8B's exact shapes (ReFusion's backbone)."""
  base = dict(
      vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
      num_kv_heads=8, head_dim=128, mlp_dim=12288, rope_theta=1_000_000.0,
      rms_eps=1e-6, tie_embeddings=False, max_position_embeddings=40960,
      dtype="bfloat16", param_dtype="bfloat16", mask_token_id=None,
      bos_token_id=None, eos_token_id=QWEN3_EOS_ID, pad_token_id=QWEN3_PAD_ID)
  base.update(overrides)
  return ModelConfig(**base)


def qwen3_0_6b(**overrides) -> ModelConfig:
  """Qwen3-0.6B's exact shapes."""
  base = dict(
      vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
      num_kv_heads=8, head_dim=128, mlp_dim=3072, rope_theta=1_000_000.0,
      rms_eps=1e-6, tie_embeddings=True, max_position_embeddings=40960,
      dtype="bfloat16", param_dtype="bfloat16", mask_token_id=None,
      bos_token_id=None, eos_token_id=QWEN3_EOS_ID, pad_token_id=QWEN3_PAD_ID)
  base.update(overrides)
  return ModelConfig(**base)


def qwen2_5_7b(**overrides) -> ModelConfig:
  """Qwen2.5-7B's exact shapes (Dream-7B's backbone; the paper's Table 3)."""
  base = dict(
      vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
      head_dim=128, mlp_dim=18944, rope_theta=1_000_000.0, rms_eps=1e-6,
      tie_embeddings=False, max_position_embeddings=131072, dtype="bfloat16",
      param_dtype="bfloat16", mask_token_id=None, bos_token_id=None,
      eos_token_id=QWEN3_EOS_ID, pad_token_id=QWEN3_PAD_ID, model_type="qwen2")
  base.update(overrides)
  return ModelConfig(**base)


# Dream-7B's mask token (<|mask|>) and the <|endoftext|> its config.json gives as
# bos, eos and pad.
DREAM_MASK_ID = 151666
DREAM_EOS_ID = 151643


def dream_7b(**overrides) -> ModelConfig:
  """Dream-v0-7B's shapes (Qwen2.5-7B's, bidirectional, logits shifted by one; the
  paper's Table 3)."""
  base = dict(model_type="dream", attention="bidirectional", mask_token_id=DREAM_MASK_ID,
              bos_token_id=DREAM_EOS_ID, eos_token_id=DREAM_EOS_ID, pad_token_id=DREAM_EOS_ID)
  base.update(overrides)
  return qwen2_5_7b(**base)


# Llama-3's tokenizer: <|begin_of_text|>, <|end_of_text|>, <|eot_id|> (the end of an
# Instruct model's turn, its generation_config's first EOS).
LLAMA3_BOS_ID, LLAMA3_EOS_ID, LLAMA3_EOT_ID = 128000, 128001, 128009


def llama3_8b(**overrides) -> ModelConfig:
  """Llama-3-8B(-Instruct)'s shapes (Table 1's AR row); Llama-3.1-8B adds the llama3
  RoPE scaling (factor 8, low 1, high 4, original 8192) and 131072 positions."""
  base = dict(
      vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
      head_dim=128, mlp_dim=14336, rope_theta=500_000.0, rms_eps=1e-5,
      tie_embeddings=False, max_position_embeddings=8192, dtype="bfloat16",
      param_dtype="bfloat16", mask_token_id=None, bos_token_id=LLAMA3_BOS_ID,
      eos_token_id=LLAMA3_EOT_ID, pad_token_id=None, model_type="llama",
      stop_token_ids=(LLAMA3_EOS_ID,))
  base.update(overrides)
  return ModelConfig(**base)


# LLaDA-8B's tokenizer: <|startoftext|>, <|endoftext|> (EOS and pad), <|mdm_mask|>, and
# <|eot_id|> (the end of an Instruct turn).
LLADA_BOS_ID, LLADA_EOS_ID, LLADA_MASK_ID, LLADA_EOT_ID = 126080, 126081, 126336, 126348


def llada_8b(**overrides) -> ModelConfig:
  """LLaDA-8B(-Instruct)'s shapes (Table 1's MDM row): Llama's block without a causal
  mask and without GQA, its own tensor names (`model_type="llada"`)."""
  base = dict(
      vocab_size=126464, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
      head_dim=128, mlp_dim=12288, rope_theta=500_000.0, rms_eps=1e-5,
      tie_embeddings=False, max_position_embeddings=4096, dtype="bfloat16",
      param_dtype="bfloat16", attention="bidirectional", mask_token_id=LLADA_MASK_ID,
      bos_token_id=LLADA_BOS_ID, eos_token_id=LLADA_EOS_ID, pad_token_id=LLADA_EOS_ID,
      model_type="llada", stop_token_ids=(LLADA_EOT_ID,))
  base.update(overrides)
  return ModelConfig(**base)


# A refusion_jax model folder's config (beside its params/; see checkpoint.py).
MODEL_CONFIG_FILE = "model_config.json"


def read_model_config(directory: str) -> ModelConfig:
  """The `ModelConfig` of a refusion_jax model folder, read without its weights."""
  path = os.path.join(directory, MODEL_CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no {MODEL_CONFIG_FILE} in {directory}: not a refusion_jax model folder")
  fields = fileio.read_json(path)
  if not isinstance(fields, dict):
    raise ValueError(f"{path}: expected a JSON object of ModelConfig fields, got "
                     f"{type(fields).__name__}")
  unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    raise ValueError(f"{path}: unknown ModelConfig field(s) {unknown}")
  try:
    return ModelConfig(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from None


def is_model_dir(directory: str) -> bool:
  return os.path.exists(os.path.join(directory, MODEL_CONFIG_FILE))


def tiny(**overrides) -> ModelConfig:
  """A 4-layer d=128 model that trains at ~10k tokens/s on a 2-core CPU.

  Special token ids match the bundled tiny tokenizer (see tokenizer.py).
  """
  base = dict(
      vocab_size=512, hidden_size=128, num_layers=4, num_heads=4,
      num_kv_heads=2, head_dim=32, mlp_dim=384, rope_theta=10_000.0,
      rms_eps=1e-6, tie_embeddings=True, max_position_embeddings=1024,
      dtype="float32", param_dtype="float32", pad_token_id=0, eos_token_id=1,
      bos_token_id=2, mask_token_id=3)
  base.update(overrides)
  return ModelConfig(**base)


PRESETS = {"qwen3_8b": qwen3_8b, "qwen3_0_6b": qwen3_0_6b, "qwen2_5_7b": qwen2_5_7b,
           "dream_7b": dream_7b, "llama3_8b": llama3_8b, "llada_8b": llada_8b, "tiny": tiny}


def get_preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name](**overrides)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def _rope(hf: Mapping[str, Any], where: str) -> dict:
  """ModelConfig's RoPE fields from a config.json: `rope_theta`, and Llama 3.1's
  "llama3" scaling, in transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
  (`rope_parameters`) layout. Any other scaling is one error naming it."""
  params = hf.get("rope_parameters")
  scaling = params if isinstance(params, Mapping) else hf.get("rope_scaling")
  out = {}
  if isinstance(params, Mapping) and "rope_theta" in params:
    out["rope_theta"] = float(params["rope_theta"])
  elif "rope_theta" in hf:
    out["rope_theta"] = float(hf["rope_theta"])
  else:
    out["rope_theta"] = 10_000.0
  kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
  if kind in ("default", None):
    return out
  key = "rope_parameters" if scaling is params else "rope_scaling"
  if kind != "llama3":
    raise ValueError(f"{where}: {key}.rope_type={kind!r} is not supported (plain RoPE, or "
                     "Llama 3.1's 'llama3')")
  missing = [k for k in _LLAMA3_KEYS if k not in scaling]
  if missing:
    raise ValueError(f"{where}: {key} has rope_type 'llama3' but lacks {missing} (Llama "
                     "3.1's folders give factor 8, low_freq_factor 1, high_freq_factor 4, "
                     "original_max_position_embeddings 8192)")
  out.update(rope_scaling_factor=float(scaling["factor"]),
             rope_low_freq_factor=float(scaling["low_freq_factor"]),
             rope_high_freq_factor=float(scaling["high_freq_factor"]),
             rope_original_max_positions=int(scaling["original_max_position_embeddings"]))
  return out


def _ids(value, where: str) -> list[int]:
  """An `eos_token_id` field (an id or a list of them) as a list."""
  if value is None:
    return []
  values = value if isinstance(value, (list, tuple)) else [value]
  if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
    raise ValueError(f"{where}: eos_token_id must be an id or a list of ids, got {value!r}")
  return list(values)


def _first_id(value):
  if isinstance(value, (list, tuple)):
    return int(value[0]) if value else None
  return None if value is None else int(value)


def from_hf_config(path_or_dict, **overrides) -> ModelConfig:
  """Builds a ModelConfig from a HF `config.json` (a path, a folder or a dict).

  `model_type` "qwen3", "qwen2" (Qwen2 and Qwen2.5), "Dream" (Dream-7B: Qwen2.5's
  layout, bidirectional, logits shifted by one; its `mask_token_id` is required) or
  "llama" (Llama-3, and 3.1 with its "llama3" RoPE scaling); any other family is one
  error naming it and the supported ones. Reads transformers
  4.x (`rope_theta`) and 5.x (`rope_parameters`) layouts, and the `mask_token_id`
  that ReFusion checkpoints carry. Keys it does not use (`auto_map`, ...) are ignored.
  """
  generation = {}
  if isinstance(path_or_dict, Mapping):
    hf, where = dict(path_or_dict), "config.json"
  else:
    where = os.fspath(path_or_dict)
    if os.path.isdir(where):
      where = os.path.join(where, "config.json")
    if not os.path.exists(where):
      raise FileNotFoundError(f"no config.json at {where}")
    hf = fileio.read_json(where)
    if not isinstance(hf, dict):
      raise ValueError(f"{where}: expected a JSON object, got {type(hf).__name__}")
    gen_path = os.path.join(os.path.dirname(where), "generation_config.json")
    if os.path.isfile(gen_path):
      generation = fileio.read_json(gen_path)
      if not isinstance(generation, dict):
        raise ValueError(f"{gen_path}: expected a JSON object, got {type(generation).__name__}")
  hf_model_type = hf.get("model_type") or "qwen3"
  if hf_model_type == "llada":
    hf = _llada_as_common(hf, where)
  ours = {theirs: name for name, theirs in HF_MODEL_TYPES.items()}
  if hf_model_type not in ours:
    raise ValueError(f"{where}: model_type={hf_model_type!r} is not supported; supported: "
                     f"{', '.join(HF_MODEL_TYPES.values())}")
  model_type = ours[hf_model_type]
  if hf.get("use_sliding_window"):
    raise ValueError(f"{where}: use_sliding_window=true is not supported (full attention only)")
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")
  missing = [k for k in required if k not in hf]
  if missing:
    raise ValueError(f"{where}: missing field(s) {missing}")
  num_heads = int(hf["num_attention_heads"])
  hidden = int(hf["hidden_size"])
  dtype = hf.get("torch_dtype", hf.get("dtype", "float32")) or "float32"
  if dtype not in _DTYPES:
    dtype = "float32"
  kwargs = dict(
      vocab_size=int(hf["vocab_size"]),
      hidden_size=hidden,
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=num_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
      head_dim=int(hf.get("head_dim") or hidden // num_heads),
      mlp_dim=int(hf["intermediate_size"]),
      **_rope(hf, where),
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
      dtype=dtype,
      param_dtype=dtype,
      mask_token_id=_first_id(hf.get("mask_token_id")),
      bos_token_id=_first_id(hf.get("bos_token_id")),
      eos_token_id=_first_id(hf.get("eos_token_id")),
      pad_token_id=_first_id(hf.get("pad_token_id")),
      objective=str(hf.get(HF_OBJECTIVE_KEY) or ""),
      model_type=model_type,
  )
  # Every EOS config.json and generation_config.json name, and the family's end-of-turn
  # ids, stop decoding; those outside the vocabulary are left out below.
  stops = [*_ids(hf.get("eos_token_id"), where), *_ids(generation.get("eos_token_id"), where),
           *FAMILIES[model_type].stop_token_ids]
  kwargs["stop_token_ids"] = tuple(dict.fromkeys(
      v for v in stops if v != kwargs["eos_token_id"] and 0 <= v < kwargs["vocab_size"]))
  if len(kwargs["stop_token_ids"]) > MAX_STOP_IDS - 1:
    raise ValueError(f"{where}: {len(kwargs['stop_token_ids']) + 1} end-of-response ids "
                     f"(eos_token_id {kwargs['eos_token_id']} and {kwargs['stop_token_ids']}); "
                     f"at most {MAX_STOP_IDS} are supported")
  if model_type in ("qwen3", "llama") and hf.get("attention_bias"):
    raise ValueError(f"{where}: attention_bias=true is not supported by the "
                     f"{hf_model_type} backbone")
  if hf.get("mlp_bias"):
    raise ValueError(f"{where}: mlp_bias=true is not supported (no MLP biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (SwiGLU "
                     "with silu)")
  if FAMILIES[model_type].attention:
    kwargs["attention"] = FAMILIES[model_type].attention
  if model_type == "llada" and kwargs["mask_token_id"] is None:
    raise ValueError(f"{where}: model_type='llada' needs mask_token_id (126336 in "
                     "LLaDA-8B's config.json), found none")
  if model_type == "dream":
    # Dream attends both ways; it decodes by unmasking, so its mask token is required.
    if kwargs["mask_token_id"] is None:
      raise ValueError(f"{where}: model_type='Dream' needs mask_token_id (151666 in "
                       "Dream-v0's config.json), found none")
    if hf.get("attention_bias") is False:
      raise ValueError(f"{where}: attention_bias=false, but Dream's q, k and v projections "
                       "carry biases")
  kwargs.update(overrides)
  # Ids that fall outside a resized vocabulary are dropped rather than kept wrong.
  for name in ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
    if name not in overrides and kwargs[name] is not None and kwargs[name] >= kwargs["vocab_size"]:
      if model_type in ("dream", "llada") and name == "mask_token_id":
        raise ValueError(f"{where}: mask_token_id={kwargs[name]} is outside the "
                         f"vocabulary of {kwargs['vocab_size']} rows")
      kwargs[name] = None
  return ModelConfig(**kwargs)


# LLaDA's config.json (its OLMo-derived LLaDAConfig): what its keys must say for the
# block to be Llama's, and how the others map to transformers' names.
_LLADA_FIXED = {"block_type": "llama", "activation_type": "silu", "include_bias": False,
                "include_qkv_bias": False, "layer_norm_type": "rms", "rope": True,
                "alibi": False, "attention_layer_norm": False, "scale_logits": False,
                "input_emb_norm": False, "bias_for_layer_norm": False}
_LLADA_KEYS = {"d_model": "hidden_size", "n_layers": "num_hidden_layers",
               "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
               "mlp_hidden_size": "intermediate_size", "weight_tying": "tie_word_embeddings",
               "max_sequence_length": "max_position_embeddings"}


def _llada_as_common(hf: Mapping[str, Any], where: str) -> dict:
  """A LLaDA config.json under transformers' key names (`from_hf_config` reads those),
  every key that makes its block other than Llama's refused by name."""
  wrong = {k: hf[k] for k, want in _LLADA_FIXED.items() if k in hf and hf[k] != want}
  if wrong:
    raise ValueError(f"{where}: model_type='llada' with {wrong}: only LLaDA's Llama block "
                     f"({_LLADA_FIXED}) is supported")
  missing = [k for k in ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size")
             if k not in hf]
  if missing:
    raise ValueError(f"{where}: missing field(s) {missing} (LLaDA's config.json names)")
  vocab = hf.get("embedding_size") or hf["vocab_size"]
  if vocab != hf["vocab_size"]:
    raise ValueError(f"{where}: embedding_size={hf['embedding_size']} differs from "
                     f"vocab_size={hf['vocab_size']}; not supported")
  out = {k: v for k, v in hf.items() if k not in _LLADA_KEYS}
  out.update({theirs: hf[ours] for ours, theirs in _LLADA_KEYS.items() if ours in hf})
  out["num_key_value_heads"] = hf.get("n_kv_heads") or hf["n_heads"]
  out["hidden_act"] = "silu"
  out["dtype"] = {"amp_bf16": "bfloat16", "amp_fp16": "float16"}.get(hf.get("precision"),
                                                                     hf.get("torch_dtype"))
  return out


# The key of a HF config.json that holds `ModelConfig.objective` (transformers ignores it).
HF_OBJECTIVE_KEY = "refusion_jax_objective"


def to_hf_config(config: ModelConfig) -> dict:
  """The HF `config.json` dict (transformers 4.x layout, which 5.x also reads).

  A Dream model is written as Dream's folders name it (`model_type` "Dream",
  `DreamModel`), without `auto_map`: transformers runs such a folder only beside
  Dream's own configuration_dream.py and modeling_dream.py, which are not written.
  """
  hf = {
      "architectures": [config.family.architecture],
      "model_type": HF_MODEL_TYPES[config.model_type],
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "intermediate_size": config.mlp_dim,
      "hidden_act": "silu",
      "rope_theta": config.rope_theta,
      "rope_scaling": None if not config.rope_scaling_factor else {
          "rope_type": "llama3", "factor": config.rope_scaling_factor,
          "low_freq_factor": config.rope_low_freq_factor,
          "high_freq_factor": config.rope_high_freq_factor,
          "original_max_position_embeddings": config.rope_original_max_positions},
      "rms_norm_eps": config.rms_eps,
      "tie_word_embeddings": config.tie_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "attention_bias": config.qkv_bias,
      "attention_dropout": 0.0,
      "use_sliding_window": False,
      "torch_dtype": config.param_dtype,
  }
  if config.objective:
    hf[HF_OBJECTIVE_KEY] = config.objective
  for ours, theirs in (("mask_token_id", "mask_token_id"), ("bos_token_id", "bos_token_id"),
                       ("eos_token_id", "eos_token_id"), ("pad_token_id", "pad_token_id")):
    value = getattr(config, ours)
    if value is not None:
      hf[theirs] = value
  if config.stop_token_ids and config.eos_token_id is not None and config.model_type != "llada":
    # Every id that ends a response, EOS first (Llama 3.1's and Qwen3's layout; LLaDA's
    # code reads one id, and its end of turn is the family's, known on the way back in).
    hf["eos_token_id"] = [config.eos_token_id, *config.stop_token_ids]
  if config.model_type == "llada":
    # LLaDA's own keys (its folders run with its remote code, which is not written).
    llada = {ours: hf[theirs] for ours, theirs in _LLADA_KEYS.items()}
    llada.update(_LLADA_FIXED, architectures=hf["architectures"], model_type="llada",
                 vocab_size=config.vocab_size, embedding_size=config.vocab_size,
                 rope_theta=config.rope_theta, rms_norm_eps=config.rms_eps,
                 precision={"bfloat16": "amp_bf16", "float16": "amp_fp16"}.get(
                     config.param_dtype, config.param_dtype),
                 **{k: hf[k] for k in ("mask_token_id", "bos_token_id", "eos_token_id",
                                       "pad_token_id") if k in hf})
    return llada
  return hf
