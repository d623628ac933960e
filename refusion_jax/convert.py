r"""Converts between Hugging Face Qwen3 folders and refusion_jax model folders.

HF -> ours (config.json + safetensors -> model_config.json + orbax params; `--hf_dir`
may name a shipped model, `refusion_tiny` or `base_tiny`, as any model reference may:
`loading.resolve`):

  python -m refusion_jax.convert --hf_dir=/ckpt/ReFusion --out_dir=/models/refusion

ours -> HF (loadable by transformers' Qwen3ForCausalLM):

  python -m refusion_jax.convert --to_hf --out_dir=/models/refusion --hf_dir=/export/hf

`--out_dir` is always our folder and `--hf_dir` always the HF folder; `--to_hf`
only picks the direction. The destination must not exist unless
`--overwrite` is given; it is written atomically either way.
"""

from __future__ import annotations

import os

from absl import app, flags

from refusion_jax import checkpoint, entry_flags, hf, loading
from refusion_jax import config as config_lib

_HF_DIR = flags.DEFINE_string(
    "hf_dir", None, "HF checkpoint folder (config.json + model.safetensors or shards): the "
    "source, or the destination with --to_hf.")
_OUT_DIR = flags.DEFINE_string(
    "out_dir", None, "refusion_jax model folder (model_config.json + params/): the "
    "destination, or the source with --to_hf.")
_TO_HF = flags.DEFINE_bool(
    "to_hf", False, "Convert our model folder --out_dir into a HF folder --hf_dir.")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16", "float16"],
    "HF -> ours only: parameter dtype to store (default: config.json's torch_dtype).")
_MAX_SHARD_BYTES = flags.DEFINE_integer(
    "max_shard_bytes", hf.DEFAULT_MAX_SHARD_BYTES,
    "--to_hf only: split the safetensors into shards of at most this many bytes.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the destination if it exists.")
flags.mark_flags_as_required(["hf_dir", "out_dir"])


def convert(hf_dir: str, out_dir: str, *, to_hf: bool = False, dtype: str | None = None,
            max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> None:
  """Library form of the CLI (see the module docstring)."""
  if not hf_dir:
    raise ValueError("--hf_dir is required")
  if not out_dir:
    raise ValueError("--out_dir is required")
  if not to_hf:
    hf_dir = loading.model_dir(hf_dir, "--hf_dir")  # a shipped model's name, or a folder
  src, dst = (out_dir, hf_dir) if to_hf else (hf_dir, out_dir)
  if os.path.abspath(src) == os.path.abspath(dst):
    raise ValueError(f"--hf_dir and --out_dir are the same folder {src!r}")
  if os.path.exists(dst) and not overwrite:
    raise FileExistsError(f"destination {dst!r} already exists (pass --overwrite to replace it)")
  if to_hf:
    if dtype is not None:
      raise ValueError("--dtype applies to HF -> ours only; --to_hf keeps the stored dtype")
    if not os.path.isdir(out_dir):
      raise FileNotFoundError(f"--out_dir={out_dir!r} does not exist (with --to_hf it is the "
                              "source model folder)")
    config_lib.read_model_config(out_dir)  # not a model folder: said before the weights load
  else:
    hf.read_config(hf_dir)  # config.json and the tensor headers, checked before the weights load
  if to_hf:
    config, model = checkpoint.load_model(out_dir)
    hf.save(config, model, hf_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
  else:
    config, model = hf.load(hf_dir, dtype=dtype)
    checkpoint.save_model(out_dir, config, model, overwrite=overwrite)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  convert(_HF_DIR.value, _OUT_DIR.value, to_hf=_TO_HF.value, dtype=_DTYPE.value,
          max_shard_bytes=_MAX_SHARD_BYTES.value, overwrite=_OVERWRITE.value)
  direction = f"{_OUT_DIR.value} -> {_HF_DIR.value}" if _TO_HF.value else (
      f"{_HF_DIR.value} -> {_OUT_DIR.value}")
  print(f"converted {direction}")


if __name__ == "__main__":
  entry_flags.run_program(main, "refusion_jax.convert", user_errors=(ValueError, OSError))
