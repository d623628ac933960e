"""Models and their tokenizers by reference: the one rule every entry point loads by.

A model reference (sample's, serve's, evaluate's and lm-eval's `model_dir`, distill's
`base_dir`, RL's `model_dir`, train's `init_from_hf`, a benchmark's `--model_dir`) is

- the short name of a model shipped in the package (`base_tiny`, `refusion_tiny`:
  `packaged.SHIPPED_MODELS`), unless the working directory has a folder of that name;
- a refusion_jax model folder (model_config.json beside params/: `checkpoint`), or
- a Hugging Face folder (config.json + safetensors: `hf`).

An adapter folder (a PEFT LoRA, e.g. a D2F adapter) is merged into the weights
(`lora.merge`). The tokenizer of a model is `tokenizer_dir` when one is given, else the
model folder's tokenizer.json, else the bundled tiny tokenizer when the model has
`config.tiny()`'s vocabulary and special ids; otherwise there is none, and
`load_tokenizer` says so in one line naming both flags (or returns None where the
caller can go without: token-id prompts).
"""

from __future__ import annotations

import os

from refusion_jax import checkpoint, hf, lora, packaged
from refusion_jax import config as config_lib
from refusion_jax.config import ModelConfig
from refusion_jax.tokenizer import Tokenizer

MODEL_FLAG = "--config.model_dir"
TOKENIZER_FLAG = "--config.tokenizer_dir"
TOKENIZER_FILE = "tokenizer.json"


def resolve(reference: str) -> str:
  """The folder a model reference names: a shipped model's short name gives its folder
  (unless the working directory has a folder of that name); anything else is returned
  as it is (the caller reports a missing folder)."""
  if not reference or os.path.isdir(reference):
    return reference
  return packaged.SHIPPED_MODELS.get(reference, reference)


def model_dir(reference: str, flag: str = MODEL_FLAG) -> str:
  """`resolve(reference)`, which must be a folder; else one error naming `flag`."""
  if not reference:
    raise ValueError(f"{flag} is required (a HF or refusion_jax model folder)")
  folder = resolve(reference)
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"{flag}={reference!r} is not a folder (nor a shipped model: "
                            f"{', '.join(sorted(packaged.SHIPPED_MODELS))})")
  return folder


def model_arg(parser, reference: str, flag: str = "--model_dir") -> str:
  """A benchmark's model flag by the same rule (`model_dir`; "" stays "", the benchmark's
  own default), its error through `parser.error` (argparse's usage line, exit 2)."""
  try:
    return model_dir(reference, flag) if reference else ""
  except (ValueError, OSError) as e:
    parser.error(str(e))


def _model_dirs_below(folder: str, depth: int = 3, most: int = 5) -> list[str]:
  """Up to `most` model folders (refusion_jax or HF) at most `depth` levels below
  `folder` (a training workdir holds its model in models/NAME/final_model), sorted;
  the first 2000 folders are looked at."""
  found = []
  root = folder.rstrip(os.sep).count(os.sep)
  for seen, (path, dirs, files) in enumerate(os.walk(folder)):
    if seen == 2000:  # an error message's search, not a crawl
      break
    dirs.sort()
    if config_lib.MODEL_CONFIG_FILE in files or hf.CONFIG_FILE in files:
      found.append(path)
      dirs.clear()  # a model folder's own subfolders are its weights
    if path.count(os.sep) - root >= depth:
      dirs.clear()
    if len(found) >= most:
      break
  return sorted(found)


def _is_hf_folder(folder: str, flag: str) -> bool:
  """False for a refusion_jax model folder, True for a HF one; neither is an error
  naming both (and the model folders below it, if any)."""
  if config_lib.is_model_dir(folder):
    return False
  if os.path.exists(os.path.join(folder, hf.CONFIG_FILE)):
    return True
  below = _model_dirs_below(folder)
  raise FileNotFoundError(
      f"{flag}={folder!r} has neither {config_lib.MODEL_CONFIG_FILE} (refusion_jax) nor "
      f"{hf.CONFIG_FILE} (HF)" + (f"; model folders below it: {', '.join(below)}" if below
                                  else ""))


def read_model_config(reference: str, flag: str = MODEL_FLAG) -> ModelConfig:
  """The config `load_model` gives, read without loading the weights."""
  folder = model_dir(reference, flag)
  if _is_hf_folder(folder, flag):
    return hf.read_config(folder)
  return config_lib.read_model_config(folder)


def load_model(reference: str, *, scan_layers: bool | None = None, adapter_dir: str = "",
               flag: str = MODEL_FLAG):
  """`(config, model)` of a model reference (module docstring).

  `scan_layers` picks the layer layout (None: a model folder's own, unrolled for a HF
  folder); decoding gives the same tokens in either. `adapter_dir`: a PEFT LoRA folder
  merged into the weights (unrolled layers only).
  """
  folder = model_dir(reference, flag)
  if adapter_dir:
    if scan_layers:
      raise ValueError("an adapter (adapter_dir) merges into unrolled layers; "
                       "scan_layers=True cannot be combined with it")
    config, model = load_model(folder, scan_layers=False, flag=flag)
    return config, lora.merge(model, lora.read_adapter(adapter_dir, config))
  if _is_hf_folder(folder, flag):
    return hf.load(folder, scan_layers=bool(scan_layers))
  return checkpoint.load_model(folder, scan_layers=scan_layers)


def _is_tiny_shaped(config: ModelConfig) -> bool:
  ref = config_lib.tiny()
  return all(getattr(config, name) == getattr(ref, name)
             for name in ("vocab_size", "mask_token_id", "eos_token_id"))


def find_tokenizer(reference: str, model_config: ModelConfig,
                   tokenizer_dir: str = "") -> Tokenizer | None:
  """The tokenizer the rule finds for a model (module docstring), unchecked; None when
  there is none."""
  if tokenizer_dir:
    return Tokenizer.from_dir(tokenizer_dir)
  folder = resolve(reference)
  if folder and os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
    return Tokenizer.from_dir(folder)
  if _is_tiny_shaped(model_config):
    return Tokenizer.tiny()
  return None


def load_tokenizer(reference: str, model_config: ModelConfig, tokenizer_dir: str = "", *,
                   required: bool = True, flag: str = MODEL_FLAG,
                   tokenizer_flag: str = TOKENIZER_FLAG) -> Tokenizer | None:
  """`find_tokenizer`'s tokenizer, checked against the model's vocabulary and special
  ids. With none: an error naming `flag` and `tokenizer_flag`, or None unless
  `required`."""
  tokenizer = find_tokenizer(reference, model_config, tokenizer_dir)
  if tokenizer is None:
    if not required:
      return None
    raise ValueError(f"{flag}={reference!r}: no tokenizer (the folder has no "
                     f"{TOKENIZER_FILE} and the model's vocabulary and special ids are not the "
                     f"bundled tiny tokenizer's); set {tokenizer_flag}")
  tokenizer.check_compatible(model_config)
  return tokenizer
